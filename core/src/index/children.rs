//! Literal children of a trie node.
//!
//! Most nodes have few literal children (often none: leaves are the majority),
//! so they are kept in a small vector searched linearly, which is both smaller
//! and faster than hashing. Past a handful of children the node switches to a
//! hash map with the index's keyed hash.

use std::collections::HashMap;

use super::hash::{FoldState, TokenKey};
use super::NodeId;

/// Above this many children a node uses a hash map.
const SMALL_MAX: usize = 8;

#[derive(Debug)]
pub(super) enum Children {
    Small(Vec<(TokenKey, NodeId)>),
    Map(HashMap<TokenKey, NodeId, FoldState>),
}

impl Default for Children {
    fn default() -> Self {
        Children::Small(Vec::new())
    }
}

impl Children {
    #[inline]
    pub(super) fn get(&self, token: &[u8]) -> Option<NodeId> {
        match self {
            Children::Small(v) => v
                .iter()
                .find(|(t, _)| t.as_bytes() == token)
                .map(|&(_, id)| id),
            Children::Map(m) => m.get(token).copied(),
        }
    }

    /// Adds a child; the token must not be present yet.
    pub(super) fn insert(&mut self, token: &str, id: NodeId) {
        match self {
            Children::Small(v) if v.len() < SMALL_MAX => v.push((TokenKey::new(token), id)),
            Children::Small(v) => {
                let mut map = HashMap::with_capacity_and_hasher(SMALL_MAX * 2, FoldState);
                map.extend(std::mem::take(v));
                map.insert(TokenKey::new(token), id);
                *self = Children::Map(map);
            }
            Children::Map(m) => {
                m.insert(TokenKey::new(token), id);
            }
        }
    }

    pub(super) fn remove(&mut self, token: &[u8]) -> Option<NodeId> {
        match self {
            Children::Small(v) => {
                let pos = v.iter().position(|(t, _)| t.as_bytes() == token)?;
                Some(v.swap_remove(pos).1)
            }
            Children::Map(m) => {
                let id = m.remove(token)?;
                if m.is_empty() {
                    // Give the map's memory back once the node is bare.
                    *self = Children::default();
                }
                Some(id)
            }
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        match self {
            Children::Small(v) => v.is_empty(),
            Children::Map(m) => m.is_empty(),
        }
    }

    /// Every child id (for tests).
    #[cfg(test)]
    pub(super) fn ids(&self) -> Vec<NodeId> {
        match self {
            Children::Small(v) => v.iter().map(|&(_, id)| id).collect(),
            Children::Map(m) => m.values().copied().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_into_a_map_and_back() {
        let mut c = Children::default();
        for i in 0..20u32 {
            c.insert(&format!("t{i}"), i);
        }
        assert!(matches!(c, Children::Map(_)));
        for i in 0..20 {
            assert_eq!(c.get(format!("t{i}").as_bytes()), Some(i));
        }
        assert_eq!(c.get(b"t20"), None);
        for i in 0..20 {
            assert_eq!(c.remove(format!("t{i}").as_bytes()), Some(i));
        }
        assert!(c.is_empty());
        assert!(matches!(c, Children::Small(_)));
        assert_eq!(c.remove(b"t0"), None);
    }
}
