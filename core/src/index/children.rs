//! Literal children of a trie node.
//!
//! Most nodes have few literal children (often none: leaves are the majority),
//! so they are kept in a small vector searched linearly, which is both smaller
//! and faster than hashing. Past a handful of children the node switches to a
//! hash map (keyed SipHash, so peers cannot pick colliding tokens).

use std::collections::HashMap;

use super::NodeId;

/// Above this many children a node uses a hash map.
const SMALL_MAX: usize = 8;

#[derive(Debug)]
pub(super) enum Children {
    Small(Vec<(Box<str>, NodeId)>),
    Map(HashMap<Box<str>, NodeId>),
}

impl Default for Children {
    fn default() -> Self {
        Children::Small(Vec::new())
    }
}

impl Children {
    #[inline]
    pub(super) fn get(&self, token: &str) -> Option<NodeId> {
        match self {
            Children::Small(v) => v.iter().find(|(t, _)| **t == *token).map(|&(_, id)| id),
            Children::Map(m) => m.get(token).copied(),
        }
    }

    /// Adds a child; the token must not be present yet.
    pub(super) fn insert(&mut self, token: &str, id: NodeId) {
        match self {
            Children::Small(v) if v.len() < SMALL_MAX => v.push((token.into(), id)),
            Children::Small(v) => {
                let mut map: HashMap<Box<str>, NodeId> = std::mem::take(v).into_iter().collect();
                map.insert(token.into(), id);
                *self = Children::Map(map);
            }
            Children::Map(m) => {
                m.insert(token.into(), id);
            }
        }
    }

    pub(super) fn remove(&mut self, token: &str) -> Option<NodeId> {
        match self {
            Children::Small(v) => {
                let pos = v.iter().position(|(t, _)| **t == *token)?;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_into_a_map_and_back() {
        let mut c = Children::default();
        for i in 0..20 {
            c.insert(&format!("t{i}"), i);
        }
        assert!(matches!(c, Children::Map(_)));
        for i in 0..20 {
            assert_eq!(c.get(&format!("t{i}")), Some(i));
        }
        assert_eq!(c.get("t20"), None);
        for i in 0..20 {
            assert_eq!(c.remove(&format!("t{i}")), Some(i));
        }
        assert!(c.is_empty());
        assert!(matches!(c, Children::Small(_)));
        assert_eq!(c.remove("t0"), None);
    }
}
