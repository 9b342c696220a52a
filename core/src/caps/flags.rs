//! Bit sets for libfabric's OR-able flag fields: `caps`, `mode`, `mr_mode`,
//! `msg_order`, `comp_order` and `op_flags`.
//!
//! Each set carries the libfabric bit values of the flags it knows (taken
//! from `rdma/fabric.h`, so a `fi_getinfo` result converts with
//! [`Caps::from_bits`] and friends) plus the names it does not know, kept as
//! text: a dump from a newer libfabric that prints a flag this build has
//! never heard of still parses, compares and prints back unchanged.
//!
//! Known flags print in the order `fi_info` prints them (its own order, not
//! always bit order), unknown names after them in the order they were read.

use std::fmt;
use std::ops::{BitAnd, BitOr, BitOrAssign, Sub};

use serde::{Deserialize, Serialize};

/// Declares one flag-set type: a `u64` of libfabric bits plus unknown names.
macro_rules! flag_set {
    (
        $(#[$meta:meta])*
        $name:ident {
            $( $(#[$fmeta:meta])* $konst:ident = $fi:literal => $bits:expr ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub struct $name {
            bits: u64,
            unknown: Vec<String>,
        }

        impl $name {
            $(
                $(#[$fmeta])*
                #[doc = concat!("`", $fi, "`")]
                pub const $konst: $name = $name { bits: $bits, unknown: Vec::new() };
            )*

            /// Every flag this build knows: libfabric name and bit value, in
            /// the order `fi_info` prints them.
            pub const KNOWN: &'static [(&'static str, u64)] = &[ $( ($fi, $bits) ),* ];

            /// The empty set.
            pub const fn empty() -> Self {
                $name { bits: 0, unknown: Vec::new() }
            }

            /// The set with exactly these libfabric bits (as `fi_getinfo`
            /// reports them). Bits without a known name are kept and given
            /// back by [`Self::bits`], but cannot be printed by name.
            pub const fn from_bits(bits: u64) -> Self {
                $name { bits, unknown: Vec::new() }
            }

            /// The libfabric bit value of the known flags in the set.
            pub const fn bits(&self) -> u64 {
                self.bits
            }

            /// Names read from text that this build does not know.
            pub fn unknown(&self) -> &[String] {
                &self.unknown
            }

            /// No flag set, known or unknown.
            pub fn is_empty(&self) -> bool {
                self.bits == 0 && self.unknown.is_empty()
            }

            /// Every flag of `other` is in `self`.
            pub fn contains(&self, other: &Self) -> bool {
                self.bits & other.bits == other.bits
                    && other.unknown.iter().all(|n| self.unknown.contains(n))
            }

            /// Flags in both sets.
            pub fn intersection(&self, other: &Self) -> Self {
                $name {
                    bits: self.bits & other.bits,
                    unknown: self
                        .unknown
                        .iter()
                        .filter(|n| other.unknown.contains(n))
                        .cloned()
                        .collect(),
                }
            }

            /// Flags in either set.
            pub fn union(&self, other: &Self) -> Self {
                let mut out = self.clone();
                out.insert(other);
                out
            }

            /// Flags of `self` that are not in `other`.
            pub fn difference(&self, other: &Self) -> Self {
                $name {
                    bits: self.bits & !other.bits,
                    unknown: self
                        .unknown
                        .iter()
                        .filter(|n| !other.unknown.contains(n))
                        .cloned()
                        .collect(),
                }
            }

            /// Add every flag of `other`.
            pub fn insert(&mut self, other: &Self) {
                self.bits |= other.bits;
                for name in &other.unknown {
                    if !self.unknown.contains(name) {
                        self.unknown.push(name.clone());
                    }
                }
            }

            /// Remove every flag of `other`.
            pub fn remove(&mut self, other: &Self) {
                *self = self.difference(other);
            }

            /// The flag with this libfabric name, if this build knows it.
            pub fn from_name(name: &str) -> Option<Self> {
                Self::KNOWN
                    .iter()
                    .find(|(known, _)| *known == name)
                    .map(|&(_, bits)| $name::from_bits(bits))
            }

            /// Add a flag by its libfabric name; a name this build does not
            /// know is kept as text.
            pub fn insert_name(&mut self, name: &str) {
                match Self::from_name(name) {
                    Some(flag) => self.bits |= flag.bits,
                    None => {
                        if !self.unknown.iter().any(|n| n == name) {
                            self.unknown.push(name.to_string());
                        }
                    }
                }
            }

            /// The names of the flags in the set, in `fi_info` order, unknown
            /// names last.
            pub fn names(&self) -> Vec<String> {
                let mut out: Vec<String> = Self::KNOWN
                    .iter()
                    .filter(|(_, bits)| *bits != 0 && self.bits & bits == *bits)
                    .map(|(name, _)| (*name).to_string())
                    .collect();
                out.extend(self.unknown.iter().cloned());
                out
            }
        }

        impl fmt::Display for $name {
            /// Comma-separated names, or `none` for the empty set.
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let names = self.names();
                if names.is_empty() {
                    f.write_str("none")
                } else {
                    f.write_str(&names.join(", "))
                }
            }
        }

        impl BitOr for $name {
            type Output = $name;
            fn bitor(self, rhs: $name) -> $name {
                self.union(&rhs)
            }
        }

        impl BitOrAssign for $name {
            fn bitor_assign(&mut self, rhs: $name) {
                self.insert(&rhs);
            }
        }

        impl BitAnd for $name {
            type Output = $name;
            fn bitand(self, rhs: $name) -> $name {
                self.intersection(&rhs)
            }
        }

        impl Sub for $name {
            type Output = $name;
            fn sub(self, rhs: $name) -> $name {
                self.difference(&rhs)
            }
        }
    };
}

flag_set! {
    /// `fi_info.caps` (and the caps of tx, rx and domain attributes): what an
    /// endpoint can do.
    Caps {
        MSG = "FI_MSG" => 1 << 1,
        RMA = "FI_RMA" => 1 << 2,
        TAGGED = "FI_TAGGED" => 1 << 3,
        ATOMIC = "FI_ATOMIC" => 1 << 4,
        MULTICAST = "FI_MULTICAST" => 1 << 5,
        COLLECTIVE = "FI_COLLECTIVE" => 1 << 6,
        READ = "FI_READ" => 1 << 8,
        WRITE = "FI_WRITE" => 1 << 9,
        RECV = "FI_RECV" => 1 << 10,
        SEND = "FI_SEND" => 1 << 11,
        REMOTE_READ = "FI_REMOTE_READ" => 1 << 12,
        REMOTE_WRITE = "FI_REMOTE_WRITE" => 1 << 13,
        MULTI_RECV = "FI_MULTI_RECV" => 1 << 16,
        REMOTE_CQ_DATA = "FI_REMOTE_CQ_DATA" => 1 << 17,
        TRIGGER = "FI_TRIGGER" => 1 << 20,
        FENCE = "FI_FENCE" => 1 << 21,
        VARIABLE_MSG = "FI_VARIABLE_MSG" => 1 << 48,
        RMA_PMEM = "FI_RMA_PMEM" => 1 << 49,
        SOURCE_ERR = "FI_SOURCE_ERR" => 1 << 50,
        LOCAL_COMM = "FI_LOCAL_COMM" => 1 << 51,
        REMOTE_COMM = "FI_REMOTE_COMM" => 1 << 52,
        SHARED_AV = "FI_SHARED_AV" => 1 << 53,
        RMA_EVENT = "FI_RMA_EVENT" => 1 << 56,
        SOURCE = "FI_SOURCE" => 1 << 57,
        NAMED_RX_CTX = "FI_NAMED_RX_CTX" => 1 << 58,
        DIRECTED_RECV = "FI_DIRECTED_RECV" => 1 << 59,
        HMEM = "FI_HMEM" => 1 << 47,
    }
}

flag_set! {
    /// `mode` bits: requirements a provider places on the application. An
    /// info carrying a mode bit may only be used by an application that
    /// honours it.
    Mode {
        CONTEXT = "FI_CONTEXT" => 1 << 59,
        MSG_PREFIX = "FI_MSG_PREFIX" => 1 << 58,
        ASYNC_IOV = "FI_ASYNC_IOV" => 1 << 57,
        RX_CQ_DATA = "FI_RX_CQ_DATA" => 1 << 56,
        LOCAL_MR = "FI_LOCAL_MR" => 1 << 55,
        NOTIFY_FLAGS_ONLY = "FI_NOTIFY_FLAGS_ONLY" => 1 << 54,
        RESTRICTED_COMP = "FI_RESTRICTED_COMP" => 1 << 53,
        CONTEXT2 = "FI_CONTEXT2" => 1 << 52,
        BUFFERED_RECV = "FI_BUFFERED_RECV" => 1 << 51,
    }
}

flag_set! {
    /// `domain_attr.mr_mode`: in an info, the memory-registration rules the
    /// provider requires; in hints, the rules the application can follow.
    /// `FI_MR_BASIC` and `FI_MR_SCALABLE` are the 1.0 enum values, which
    /// occupy bits 0 and 1.
    MrMode {
        BASIC = "FI_MR_BASIC" => 1 << 0,
        SCALABLE = "FI_MR_SCALABLE" => 1 << 1,
        LOCAL = "FI_MR_LOCAL" => 1 << 2,
        RAW = "FI_MR_RAW" => 1 << 3,
        VIRT_ADDR = "FI_MR_VIRT_ADDR" => 1 << 4,
        ALLOCATED = "FI_MR_ALLOCATED" => 1 << 5,
        PROV_KEY = "FI_MR_PROV_KEY" => 1 << 6,
        MMU_NOTIFY = "FI_MR_MMU_NOTIFY" => 1 << 7,
        RMA_EVENT = "FI_MR_RMA_EVENT" => 1 << 8,
        ENDPOINT = "FI_MR_ENDPOINT" => 1 << 9,
        HMEM = "FI_MR_HMEM" => 1 << 10,
        COLLECTIVE = "FI_MR_COLLECTIVE" => 1 << 11,
    }
}

flag_set! {
    /// `msg_order`: which operations on one endpoint pair stay in order.
    /// `SAS` (send after send) is the one efabus cares about: without it the
    /// link needs sequence numbers and a reorder buffer.
    MsgOrder {
        RAR = "FI_ORDER_RAR" => 1 << 0,
        RAW = "FI_ORDER_RAW" => 1 << 1,
        RAS = "FI_ORDER_RAS" => 1 << 2,
        WAR = "FI_ORDER_WAR" => 1 << 3,
        WAW = "FI_ORDER_WAW" => 1 << 4,
        WAS = "FI_ORDER_WAS" => 1 << 5,
        SAR = "FI_ORDER_SAR" => 1 << 6,
        SAW = "FI_ORDER_SAW" => 1 << 7,
        SAS = "FI_ORDER_SAS" => 1 << 8,
        RMA_RAR = "FI_ORDER_RMA_RAR" => 1 << 32,
        RMA_RAW = "FI_ORDER_RMA_RAW" => 1 << 33,
        RMA_WAR = "FI_ORDER_RMA_WAR" => 1 << 34,
        RMA_WAW = "FI_ORDER_RMA_WAW" => 1 << 35,
        ATOMIC_RAR = "FI_ORDER_ATOMIC_RAR" => 1 << 36,
        ATOMIC_RAW = "FI_ORDER_ATOMIC_RAW" => 1 << 37,
        ATOMIC_WAR = "FI_ORDER_ATOMIC_WAR" => 1 << 38,
        ATOMIC_WAW = "FI_ORDER_ATOMIC_WAW" => 1 << 39,
        DATA = "FI_ORDER_DATA" => 1 << 16,
    }
}

flag_set! {
    /// `comp_order` (libfabric 1.x only): completion ordering. It uses the
    /// `FI_ORDER_*` bits; `fi_info` prints `FI_ORDER_NONE` when none of the
    /// nine basic ordering bits is set and `FI_ORDER_STRICT` when all are.
    /// Individual basic bits (which `fi_info` would not print) are printed
    /// by their `msg_order` names so nothing is lost.
    CompOrder {
        STRICT = "FI_ORDER_STRICT" => 0x1FF,
        DATA = "FI_ORDER_DATA" => 1 << 16,
    }
}

flag_set! {
    /// `op_flags` of tx and rx attributes: default flags for data transfers.
    OpFlags {
        MULTICAST = "FI_MULTICAST" => 1 << 5,
        MULTI_RECV = "FI_MULTI_RECV" => 1 << 16,
        REMOTE_CQ_DATA = "FI_REMOTE_CQ_DATA" => 1 << 17,
        MORE = "FI_MORE" => 1 << 18,
        PEEK = "FI_PEEK" => 1 << 19,
        TRIGGER = "FI_TRIGGER" => 1 << 20,
        FENCE = "FI_FENCE" => 1 << 21,
        COMPLETION = "FI_COMPLETION" => 1 << 24,
        INJECT = "FI_INJECT" => 1 << 25,
        INJECT_COMPLETE = "FI_INJECT_COMPLETE" => 1 << 26,
        TRANSMIT_COMPLETE = "FI_TRANSMIT_COMPLETE" => 1 << 27,
        DELIVERY_COMPLETE = "FI_DELIVERY_COMPLETE" => 1 << 28,
        MATCH_COMPLETE = "FI_MATCH_COMPLETE" => 1 << 31,
        AFFINITY = "FI_AFFINITY" => 1 << 29,
        CLAIM = "FI_CLAIM" => 1 << 59,
        DISCARD = "FI_DISCARD" => 1 << 58,
    }
}

/// The nine basic ordering bits that `FI_ORDER_STRICT` stands for.
const BASIC_ORDER_BITS: u64 = 0x1FF;

impl CompOrder {
    /// `FI_ORDER_NONE`: the empty set, named for symmetry with libfabric.
    pub const NONE: CompOrder = CompOrder::empty();

    /// Names as `fi_info` prints them: `FI_ORDER_NONE` or `FI_ORDER_STRICT`
    /// for the basic bits, then `FI_ORDER_DATA`, then unknown names.
    pub(crate) fn fi_names(&self) -> Vec<String> {
        let basic = self.bits & BASIC_ORDER_BITS;
        let mut out = Vec::new();
        if basic == 0 {
            out.push("FI_ORDER_NONE".to_string());
        } else if basic == BASIC_ORDER_BITS {
            out.push("FI_ORDER_STRICT".to_string());
        } else {
            // A partial set fi_info would print nothing for; name each bit.
            out.extend(
                MsgOrder::from_bits(basic)
                    .names()
                    .into_iter()
                    .filter(|n| n != "FI_ORDER_DATA"),
            );
        }
        if self.bits & CompOrder::DATA.bits != 0 {
            out.push("FI_ORDER_DATA".to_string());
        }
        // Bits outside the basic range and DATA have no comp_order name.
        let rest = self.bits & !(BASIC_ORDER_BITS | CompOrder::DATA.bits);
        out.extend(
            MsgOrder::from_bits(rest)
                .names()
                .into_iter()
                .filter(|n| n != "FI_ORDER_DATA"),
        );
        out.extend(self.unknown.iter().cloned());
        out
    }

    /// Add a flag by name as `fi_info` prints comp_order: also accepts
    /// `FI_ORDER_NONE` (adds nothing) and the individual `msg_order` names.
    pub(crate) fn insert_fi_name(&mut self, name: &str) {
        if name == "FI_ORDER_NONE" {
            return;
        }
        if CompOrder::from_name(name).is_none() {
            if let Some(order) = MsgOrder::from_name(name) {
                self.bits |= order.bits();
                return;
            }
        }
        self.insert_name(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_fabric_h() {
        assert_eq!(Caps::MSG.bits(), 0x2);
        assert_eq!(Caps::DIRECTED_RECV.bits(), 1 << 59);
        assert_eq!(Mode::MSG_PREFIX.bits(), 1 << 58);
        assert_eq!(MrMode::LOCAL.bits(), 4);
        assert_eq!(MrMode::PROV_KEY.bits(), 64);
        assert_eq!(MsgOrder::SAS.bits(), 256);
        assert_eq!(CompOrder::STRICT.bits(), 0x1FF);
    }

    #[test]
    fn set_algebra_keeps_unknown_names() {
        let mut a = Caps::MSG | Caps::SEND;
        a.insert_name("FI_FUTURE_CAP");
        let b = Caps::MSG | Caps::RECV;
        assert!(!a.contains(&b));
        assert_eq!(
            (a.clone() - b.clone()).names(),
            ["FI_SEND", "FI_FUTURE_CAP"]
        );
        assert_eq!((a.clone() & b.clone()).names(), ["FI_MSG"]);
        let u = a.union(&b);
        assert!(u.contains(&a) && u.contains(&b));
        assert_eq!(u.unknown(), ["FI_FUTURE_CAP"]);
    }

    #[test]
    fn names_follow_fi_info_order_not_bit_order() {
        let caps = Caps::HMEM | Caps::DIRECTED_RECV | Caps::MSG;
        assert_eq!(caps.names(), ["FI_MSG", "FI_DIRECTED_RECV", "FI_HMEM"]);
        assert_eq!(caps.to_string(), "FI_MSG, FI_DIRECTED_RECV, FI_HMEM");
        assert_eq!(Caps::empty().to_string(), "none");
    }

    #[test]
    fn comp_order_names() {
        assert_eq!(CompOrder::NONE.fi_names(), ["FI_ORDER_NONE"]);
        assert_eq!(
            (CompOrder::STRICT | CompOrder::DATA).fi_names(),
            ["FI_ORDER_STRICT", "FI_ORDER_DATA"]
        );
        let mut partial = CompOrder::empty();
        partial.insert_fi_name("FI_ORDER_SAS");
        assert_eq!(partial.bits(), MsgOrder::SAS.bits());
        assert_eq!(partial.fi_names(), ["FI_ORDER_SAS"]);
    }
}
