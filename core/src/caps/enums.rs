//! Enumerated fields of `fi_info`: endpoint type, protocol, threading,
//! progress, AV type, resource management, address format, bus type and
//! link state.
//!
//! Each enum knows libfabric's names and C values; a name this build does not
//! know (a newer libfabric's, or `fi_info`'s own `Unknown`) is kept in
//! `Other` so it prints back unchanged.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What `fi_info` prints for a C value it has no name for.
const UNKNOWN: &str = "Unknown";

/// Declares one enum with libfabric names and C values, plus `Other(String)`.
macro_rules! fi_enum {
    (
        $(#[$meta:meta])*
        $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $fi:literal => $c:expr ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $(
                $(#[$vmeta])*
                #[doc = concat!("`", $fi, "`")]
                $variant,
            )*
            /// A name this build does not know, kept verbatim.
            Other(String),
        }

        impl $name {
            /// The libfabric name, as `fi_info` prints it.
            pub fn name(&self) -> &str {
                match self {
                    $( $name::$variant => $fi, )*
                    $name::Other(text) => text,
                }
            }

            /// The value for a printed name; unknown names become `Other`.
            pub fn from_name(name: &str) -> Self {
                match name {
                    $( $fi => $name::$variant, )*
                    other => $name::Other(other.to_string()),
                }
            }

            /// The C enum value, for a known variant.
            pub fn c_value(&self) -> Option<u32> {
                match self {
                    $( $name::$variant => Some($c), )*
                    $name::Other(_) => None,
                }
            }

            /// The variant for a C value; an unknown value becomes
            /// `Other("Unknown")`, as `fi_info` would print it.
            pub fn from_c_value(value: u32) -> Self {
                $( if value == $c { return $name::$variant; } )*
                $name::Other(UNKNOWN.to_string())
            }
        }

        impl Default for $name {
            /// Value 0, libfabric's `UNSPEC`/`UNKNOWN` for every enum here.
            fn default() -> Self {
                $name::from_c_value(0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

fi_enum! {
    /// `ep_attr.type`: the endpoint's communication model.
    EpType {
        Unspec = "FI_EP_UNSPEC" => 0,
        /// Reliable, connected (a stream of messages).
        Msg = "FI_EP_MSG" => 1,
        /// Unreliable datagrams.
        Dgram = "FI_EP_DGRAM" => 2,
        /// Reliable datagrams, connectionless.
        Rdm = "FI_EP_RDM" => 3,
        SockStream = "FI_EP_SOCK_STREAM" => 4,
        SockDgram = "FI_EP_SOCK_DGRAM" => 5,
    }
}

impl EpType {
    /// Delivers every message, or fails the link: RDM, MSG or a socket stream.
    pub fn is_reliable(&self) -> bool {
        matches!(self, EpType::Rdm | EpType::Msg | EpType::SockStream)
    }

    /// Unreliable datagrams: DGRAM or a socket datagram.
    pub fn is_datagram(&self) -> bool {
        matches!(self, EpType::Dgram | EpType::SockDgram)
    }
}

fi_enum! {
    /// `ep_attr.protocol`: the wire protocol; two providers with the same
    /// protocol interoperate.
    Protocol {
        Unspec = "FI_PROTO_UNSPEC" => 0,
        RdmaCmIbRc = "FI_PROTO_RDMA_CM_IB_RC" => 1,
        Iwarp = "FI_PROTO_IWARP" => 2,
        IbUd = "FI_PROTO_IB_UD" => 3,
        Psmx = "FI_PROTO_PSMX" => 4,
        Udp = "FI_PROTO_UDP" => 5,
        SockTcp = "FI_PROTO_SOCK_TCP" => 6,
        Mxm = "FI_PROTO_MXM" => 7,
        IwarpRdm = "FI_PROTO_IWARP_RDM" => 8,
        IbRdm = "FI_PROTO_IB_RDM" => 9,
        Gni = "FI_PROTO_GNI" => 10,
        Rxm = "FI_PROTO_RXM" => 11,
        Rxd = "FI_PROTO_RXD" => 12,
        Mlx = "FI_PROTO_MLX" => 13,
        NetworkDirect = "FI_PROTO_NETWORKDIRECT" => 14,
        Psmx2 = "FI_PROTO_PSMX2" => 15,
        Shm = "FI_PROTO_SHM" => 16,
        Mrail = "FI_PROTO_MRAIL" => 17,
        Rstream = "FI_PROTO_RSTREAM" => 18,
        RdmaCmIbXrc = "FI_PROTO_RDMA_CM_IB_XRC" => 19,
        Efa = "FI_PROTO_EFA" => 20,
        Psmx3 = "FI_PROTO_PSMX3" => 21,
        RxmTcp = "FI_PROTO_RXM_TCP" => 22,
        Opx = "FI_PROTO_OPX" => 23,
        Cxi = "FI_PROTO_CXI" => 24,
        Xnet = "FI_PROTO_XNET" => 25,
    }
}

fi_enum! {
    /// `domain_attr.threading`: which calls may run concurrently.
    Threading {
        Unspec = "FI_THREAD_UNSPEC" => 0,
        Safe = "FI_THREAD_SAFE" => 1,
        Fid = "FI_THREAD_FID" => 2,
        Domain = "FI_THREAD_DOMAIN" => 3,
        Completion = "FI_THREAD_COMPLETION" => 4,
        Endpoint = "FI_THREAD_ENDPOINT" => 5,
    }
}

fi_enum! {
    /// Progress model (`control_progress`/`data_progress` in 1.x, `progress`
    /// in 2.x).
    Progress {
        Unspec = "FI_PROGRESS_UNSPEC" => 0,
        Auto = "FI_PROGRESS_AUTO" => 1,
        Manual = "FI_PROGRESS_MANUAL" => 2,
    }
}

fi_enum! {
    /// `domain_attr.av_type`: address vector kind.
    AvType {
        Unspec = "FI_AV_UNSPEC" => 0,
        Map = "FI_AV_MAP" => 1,
        Table = "FI_AV_TABLE" => 2,
    }
}

fi_enum! {
    /// `domain_attr.resource_mgmt`: whether the provider protects against
    /// overrunning local and remote queues.
    ResourceMgmt {
        Unspec = "FI_RM_UNSPEC" => 0,
        Disabled = "FI_RM_DISABLED" => 1,
        Enabled = "FI_RM_ENABLED" => 2,
    }
}

fi_enum! {
    /// `addr_format`: how endpoint addresses are encoded.
    AddrFormat {
        Unspec = "FI_FORMAT_UNSPEC" => 0,
        Sockaddr = "FI_SOCKADDR" => 1,
        SockaddrIn = "FI_SOCKADDR_IN" => 2,
        SockaddrIn6 = "FI_SOCKADDR_IN6" => 3,
        SockaddrIb = "FI_SOCKADDR_IB" => 4,
        Psmx = "FI_ADDR_PSMX" => 5,
        Gni = "FI_ADDR_GNI" => 6,
        Bgq = "FI_ADDR_BGQ" => 7,
        Mlx = "FI_ADDR_MLX" => 8,
        Str = "FI_ADDR_STR" => 9,
        Psmx2 = "FI_ADDR_PSMX2" => 10,
        IbUd = "FI_ADDR_IB_UD" => 11,
        Efa = "FI_ADDR_EFA" => 12,
        Psmx3 = "FI_ADDR_PSMX3" => 13,
        Opx = "FI_ADDR_OPX" => 14,
        Cxi = "FI_ADDR_CXI" => 15,
    }
}

fi_enum! {
    /// `nic.bus_attr.bus_type`.
    BusType {
        Unknown = "FI_BUS_UNKNOWN" => 0,
        Pci = "FI_BUS_PCI" => 1,
    }
}

fi_enum! {
    /// `nic.link_attr.state`.
    LinkState {
        Unknown = "FI_LINK_UNKNOWN" => 0,
        Down = "FI_LINK_DOWN" => 1,
        Up = "FI_LINK_UP" => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_values_round_trip() {
        assert_eq!(EpType::from_name("FI_EP_RDM"), EpType::Rdm);
        assert_eq!(EpType::Rdm.c_value(), Some(3));
        assert_eq!(Protocol::from_c_value(20), Protocol::Efa);
        assert_eq!(Protocol::Efa.name(), "FI_PROTO_EFA");
        assert_eq!(
            Protocol::from_name("FI_PROTO_FUTURE"),
            Protocol::Other("FI_PROTO_FUTURE".into())
        );
        assert_eq!(Protocol::from_c_value(999).name(), "Unknown");
        assert_eq!(AddrFormat::default(), AddrFormat::Unspec);
        assert_eq!(BusType::default(), BusType::Unknown);
    }

    #[test]
    fn reliability() {
        assert!(EpType::Rdm.is_reliable() && EpType::Msg.is_reliable());
        assert!(!EpType::Dgram.is_reliable() && EpType::Dgram.is_datagram());
        assert!(!EpType::Unspec.is_reliable() && !EpType::Unspec.is_datagram());
    }
}
