//! The capability model: what each transport can do, described in
//! libfabric's own terms, and how two peers agree on the links between them.
//!
//! Three steps, one submodule each:
//!
//! 1. **Describe.** [`FabricInfo`] mirrors `struct fi_info` field by field
//!    (top level, [`TxAttr`], [`RxAttr`], [`EpAttr`], [`DomainAttr`],
//!    [`FabricAttr`], [`Nic`]), with bit sets for the flag fields ([`Caps`],
//!    [`Mode`], [`MrMode`], [`MsgOrder`], [`CompOrder`], [`OpFlags`]) and
//!    enums for the enumerated ones ([`EpType`], [`Protocol`], ...). The
//!    fabric transport converts `fi_getinfo` results into it (the bit sets
//!    and enums carry libfabric's C values); `tcp` and `mem` describe
//!    themselves with [`FabricInfo::tcp`] and [`FabricInfo::mem`]. Infos
//!    print in the `fi_info --verbose` layout ([`to_fi_info_text`], or
//!    `Display` for one entry) and parse back from it
//!    ([`parse_fi_info_dump`]), in the 1.x or the 2.x layout ([`Layout`]).
//!    Flag names and enum values this build does not know are kept as text,
//!    so dumps from newer libfabric versions survive a round trip.
//! 2. **Select locally.** [`Hints`] say what efabus needs and honours;
//!    [`check`] and [`select`] match them against offered infos by
//!    `fi_getinfo`'s rules and say, for every offer that does not fit, why
//!    ([`Rejection`]).
//! 3. **Negotiate with the peer.** Each side turns what it selected into
//!    [`Offer`]s (one per usable info, tagged with its transport scheme and
//!    address) and sends them in the handshake. [`negotiate`] makes the same
//!    choice on both sides: a reliable link and optionally a best-effort
//!    (datagram) link, with the [`LinkParams`] the session needs (frame
//!    limit, prefix, sequencing, fragmentation, credit windows) and a reason
//!    for every candidate it skipped.
//!
//! All of it is pure computation on values, so a user can run it offline:
//! parse two hosts' dumps and see what efabus would choose and why.
//!
//! ```
//! use efabus_core::caps::{
//!     negotiate, parse_fi_info_dump, select, to_fi_info_text, EpType, FabricInfo, Hints, Offer,
//! };
//!
//! // Describe: the TCP transport's info, printed as `fi_info -v` would.
//! let tcp = FabricInfo::tcp(Some("127.0.0.1:7420".parse().unwrap()));
//! let text = to_fi_info_text(std::slice::from_ref(&tcp));
//! assert_eq!(parse_fi_info_dump(&text).unwrap(), [tcp.clone()]);
//!
//! // Select locally by fi_getinfo's rules.
//! let infos = [tcp.clone()];
//! let chosen = select(&Hints::efabus(EpType::Unspec), &infos);
//! assert_eq!(chosen.accepted.len(), 1);
//!
//! // Negotiate with a peer that offers TCP too.
//! let mine = [Offer::from_info("tcp", chosen.accepted[0], b"127.0.0.1:7420".to_vec())];
//! let peer = [Offer::from_info("tcp", &tcp, b"127.0.0.1:7421".to_vec())];
//! let link = negotiate(&mine, &peer, &["efa-rdm", "tcp"]).unwrap();
//! assert_eq!(link.reliable.scheme, "tcp");
//! assert!(!link.reliable.params.sequence_and_reorder);
//! println!("{link}");
//! ```

mod enums;
mod flags;
mod hints;
mod info;
mod negotiate;
mod text;

pub use enums::{
    AddrFormat, AvType, BusType, EpType, LinkState, Progress, Protocol, ResourceMgmt, Threading,
};
pub use flags::{Caps, CompOrder, Mode, MrMode, MsgOrder, OpFlags};
pub use hints::{
    check, required_mr_mode, select, Direction, Hints, Mismatch, Rejection, Selection,
};
pub use info::{
    BusAttr, DeviceAttr, DomainAttr, EpAttr, ExtraFields, FabricAttr, FabricInfo, FiVersion,
    Layout, LinkAttr, Nic, PciAttr, RxAttr, TxAttr, SYNTHETIC_QUEUE_DEPTH,
};
pub use negotiate::{
    negotiate, Choice, LinkParams, Negotiated, NegotiationError, Offer, MAX_WIRE_FRAME,
    MIN_FRAME_LIMIT, TCP_SCHEME,
};
pub use text::{parse_fi_info_dump, to_fi_info_text, ParseError};
