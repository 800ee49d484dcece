//! The one place that builds (and parses back) etcd keys and NATS subjects.
//!
//! ```text
//! etcd  /tandem/{cluster}/nodes/{role}/{node_id}   node info (JSON), under the node's lease
//!       /tandem/{cluster}/layout                   the cluster's KV layout (JSON), no lease
//!       /tandem/{cluster}/drain/{role}/{node_id}   a request that the node drain and leave
//!       /tandem/{cluster}/scale/{role}             the size the pool is asked to have
//!       /tandem/{cluster}/scale-limits             each pool's min and max
//!       /tandem/{cluster}/planner/leader           the acting planner, under its lease
//!       /tandem/{cluster}/ratelimit/{key_id}       one API key's shared rate-limit buckets
//!       /tandem/{cluster}/usage/{key_id}           the usage ledger's record for one API key id
//! NATS  tandem.{cluster}.load.{role}.{node_id}     load reports (JSON)
//!       tandem.{cluster}.kv.{node_id}              KV block stored/evicted events
//!       tandem.{cluster}.planner.decisions         every scaling decision (JSON)
//! ```
//!
//! Prefixes and wildcards for listing and watching: `/tandem/{cluster}/` (everything the
//! cluster keeps in etcd), `/tandem/{cluster}/nodes/`, `/tandem/{cluster}/nodes/{role}/`,
//! `/tandem/{cluster}/usage/`, `tandem.{cluster}.load.{role}.*` and `tandem.{cluster}.kv.*`.
//! Node keys, load subjects and KV subjects parse back to their role and node id.
//!
//! # Invariants
//! - Every name (cluster, node id) is one *segment*: it is percent-encoded so that nothing in it
//!   can change the address. Only `A-Z a-z 0-9 - _` pass through; every other byte (`.` `/` `*`
//!   `>` `%`, spaces, non-ASCII UTF-8) becomes `%XX` with upper-case hex. So `a.b` can never
//!   become two NATS tokens, `a/b` never two etcd levels, and `*` or `>` never a wildcard
//!   (Dynamo's `EventScope::subject_prefix()` does the same).
//! - The encoding is canonical: [`decode_segment`] accepts only what [`encode_segment`] produces,
//!   so one name has exactly one address and parsing a key back is exact.
//! - Names are never empty (an empty segment would make `a//b` or `a..b`).
//!
//! Cost: one small allocation per key; nothing here is on a per-token path.

use crate::error::ClusterError;
use crate::node::Role;

const ETCD_ROOT: &str = "/tandem";
const SUBJECT_ROOT: &str = "tandem";

/// Percent-encodes one name so it is exactly one etcd path level and one NATS token.
pub fn encode_segment(what: &'static str, raw: &str) -> Result<String, ClusterError> {
    if raw.is_empty() {
        return Err(ClusterError::InvalidName {
            what,
            value: String::new(),
            reason: "must not be empty",
        });
    }
    let mut out = String::with_capacity(raw.len());
    for &b in raw.as_bytes() {
        if is_unreserved(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(hex_digit(b >> 4));
            out.push(hex_digit(b & 0xf));
        }
    }
    Ok(out)
}

/// Decodes a segment made by [`encode_segment`]; refuses anything else (non-canonical escapes,
/// raw reserved characters, invalid UTF-8).
pub fn decode_segment(segment: &str) -> Result<String, ClusterError> {
    let malformed = |reason| ClusterError::MalformedAddress {
        what: "segment",
        value: segment.to_string(),
        reason,
    };
    if segment.is_empty() {
        return Err(malformed("empty segment"));
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let (hi, lo) = match (bytes.get(i + 1), bytes.get(i + 2)) {
                (Some(&h), Some(&l)) => (h, l),
                _ => return Err(malformed("truncated %-escape")),
            };
            let v = match (hex_value(hi), hex_value(lo)) {
                (Some(h), Some(l)) => (h << 4) | l,
                _ => return Err(malformed("%-escape is not two upper-case hex digits")),
            };
            if is_unreserved(v) {
                return Err(malformed("%-escape of a character that needs none"));
            }
            out.push(v);
            i += 3;
        } else if is_unreserved(b) {
            out.push(b);
            i += 1;
        } else {
            return Err(malformed("raw reserved character"));
        }
    }
    String::from_utf8(out).map_err(|_| malformed("escapes do not decode to UTF-8"))
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
}

fn hex_digit(v: u8) -> char {
    char::from_digit(u32::from(v), 16)
        .expect("nibble < 16")
        .to_ascii_uppercase()
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// The keys and subjects of one cluster. Cheap to clone; build once and share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterKeys {
    cluster: String,
    cluster_segment: String,
}

impl ClusterKeys {
    /// Keys for the cluster named `cluster` (any non-empty string).
    pub fn new(cluster: &str) -> Result<Self, ClusterError> {
        let cluster_segment = encode_segment("cluster", cluster)?;
        Ok(Self {
            cluster: cluster.to_string(),
            cluster_segment,
        })
    }

    /// The cluster name, as given.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// `/tandem/{cluster}/`: everything this cluster keeps in etcd.
    pub fn cluster_prefix(&self) -> String {
        format!("{ETCD_ROOT}/{}/", self.cluster_segment)
    }

    /// `/tandem/{cluster}/nodes/`: every registered node, any role.
    pub fn nodes_prefix(&self) -> String {
        format!("{}nodes/", self.cluster_prefix())
    }

    /// `/tandem/{cluster}/nodes/{role}/`: the nodes of one role.
    pub fn role_prefix(&self, role: Role) -> String {
        format!("{}{}/", self.nodes_prefix(), role.as_str())
    }

    /// `/tandem/{cluster}/nodes/{role}/{node_id}`.
    pub fn node_key(&self, role: Role, node_id: &str) -> Result<String, ClusterError> {
        Ok(format!(
            "{}{}",
            self.role_prefix(role),
            encode_segment("node id", node_id)?
        ))
    }

    /// `/tandem/{cluster}/drain/{role}/{node_id}`: a request that the node drain and leave
    /// (written by `tandem drain` and the scaling executors, consumed by the node).
    pub fn drain_key(&self, role: Role, node_id: &str) -> Result<String, ClusterError> {
        Ok(format!(
            "{}drain/{}/{}",
            self.cluster_prefix(),
            role.as_str(),
            encode_segment("node id", node_id)?
        ))
    }

    /// `/tandem/{cluster}/scale/{role}`: the size the pool is asked to have (written by the
    /// planner and `tandem scale`, acted on by an executor).
    pub fn scale_key(&self, role: Role) -> String {
        format!("{}scale/{}", self.cluster_prefix(), role.as_str())
    }

    /// `/tandem/{cluster}/scale-limits`: each pool's min and max, written by whoever runs the
    /// executor (`tandem up`), checked by `tandem scale`.
    pub fn scale_limits_key(&self) -> String {
        format!("{}scale-limits", self.cluster_prefix())
    }

    /// `/tandem/{cluster}/planner/leader`: the acting planner's key (under its lease).
    pub fn planner_leader_key(&self) -> String {
        format!("{}planner/leader", self.cluster_prefix())
    }

    /// `tandem.{cluster}.planner.decisions`: every scaling decision, as JSON.
    pub fn planner_decisions_subject(&self) -> String {
        format!("{SUBJECT_ROOT}.{}.planner.decisions", self.cluster_segment)
    }

    /// `/tandem/{cluster}/usage/`: the usage ledger, one record per API key id.
    pub fn usage_prefix(&self) -> String {
        format!("{}usage/", self.cluster_prefix())
    }

    /// `/tandem/{cluster}/ratelimit/{key_id}`: one API key's shared rate-limit buckets.
    pub fn rate_limit_key(&self, key_id: &str) -> Result<String, ClusterError> {
        Ok(format!(
            "{}ratelimit/{}",
            self.cluster_prefix(),
            encode_segment("key id", key_id)?
        ))
    }

    /// `/tandem/{cluster}/usage/{key_id}`.
    pub fn usage_key(&self, key_id: &str) -> Result<String, ClusterError> {
        Ok(format!(
            "{}{}",
            self.usage_prefix(),
            encode_segment("key id", key_id)?
        ))
    }

    /// `/tandem/{cluster}/layout`: the KV layout every node of the cluster must share.
    pub fn layout_key(&self) -> String {
        format!("{}layout", self.cluster_prefix())
    }

    /// Parses a key made by [`ClusterKeys::node_key`] back into its role and node id.
    pub fn parse_node_key(&self, key: &str) -> Result<(Role, String), ClusterError> {
        let malformed = |reason| ClusterError::MalformedAddress {
            what: "etcd key",
            value: key.to_string(),
            reason,
        };
        let rest = key
            .strip_prefix(self.nodes_prefix().as_str())
            .ok_or_else(|| malformed("not under this cluster's nodes prefix"))?;
        let (role, node) = rest
            .split_once('/')
            .ok_or_else(|| malformed("no role level"))?;
        if node.contains('/') {
            return Err(malformed("too many levels"));
        }
        let role: Role = role.parse().map_err(|_| malformed("unknown role"))?;
        Ok((role, decode_segment(node)?))
    }

    /// `tandem.{cluster}.load.{role}.{node_id}`: where a node publishes its load reports.
    pub fn load_subject(&self, role: Role, node_id: &str) -> Result<String, ClusterError> {
        Ok(format!(
            "{}.{}",
            self.load_role_prefix(role),
            encode_segment("node id", node_id)?
        ))
    }

    /// `tandem.{cluster}.load.{role}.*`: every load report of one role.
    pub fn load_wildcard(&self, role: Role) -> String {
        format!("{}.*", self.load_role_prefix(role))
    }

    fn load_role_prefix(&self, role: Role) -> String {
        format!(
            "{SUBJECT_ROOT}.{}.load.{}",
            self.cluster_segment,
            role.as_str()
        )
    }

    /// Parses a subject made by [`ClusterKeys::load_subject`] back into role and node id.
    pub fn parse_load_subject(&self, subject: &str) -> Result<(Role, String), ClusterError> {
        let malformed = |reason| ClusterError::MalformedAddress {
            what: "NATS subject",
            value: subject.to_string(),
            reason,
        };
        let prefix = format!("{SUBJECT_ROOT}.{}.load.", self.cluster_segment);
        let rest = subject
            .strip_prefix(prefix.as_str())
            .ok_or_else(|| malformed("not a load subject of this cluster"))?;
        let (role, node) = rest
            .split_once('.')
            .ok_or_else(|| malformed("no role token"))?;
        if node.contains('.') {
            return Err(malformed("too many tokens"));
        }
        let role: Role = role.parse().map_err(|_| malformed("unknown role"))?;
        Ok((role, decode_segment(node)?))
    }

    /// `tandem.{cluster}.kv.{node_id}`: a node's KV block stored/evicted events.
    pub fn kv_subject(&self, node_id: &str) -> Result<String, ClusterError> {
        Ok(format!(
            "{}.{}",
            self.kv_prefix(),
            encode_segment("node id", node_id)?
        ))
    }

    /// `tandem.{cluster}.kv.*`: every node's KV events.
    pub fn kv_wildcard(&self) -> String {
        format!("{}.*", self.kv_prefix())
    }

    fn kv_prefix(&self) -> String {
        format!("{SUBJECT_ROOT}.{}.kv", self.cluster_segment)
    }

    /// Parses a subject made by [`ClusterKeys::kv_subject`] back into the node id.
    pub fn parse_kv_subject(&self, subject: &str) -> Result<String, ClusterError> {
        let malformed = |reason| ClusterError::MalformedAddress {
            what: "NATS subject",
            value: subject.to_string(),
            reason,
        };
        let prefix = format!("{}.", self.kv_prefix());
        let node = subject
            .strip_prefix(prefix.as_str())
            .ok_or_else(|| malformed("not a KV subject of this cluster"))?;
        if node.contains('.') {
            return Err(malformed("too many tokens"));
        }
        decode_segment(node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOSTILE: [&str; 9] = [
        "a.b",
        "a/b",
        "*",
        ">",
        "a b",
        "100%",
        "%41",
        "noeud-é",
        "x..y//z.*.>",
    ];

    #[test]
    fn plain_names_pass_through_unchanged() {
        let keys = ClusterKeys::new("prod-1").unwrap();
        assert_eq!(
            keys.node_key(Role::Decode, "d_0").unwrap(),
            "/tandem/prod-1/nodes/decode/d_0"
        );
        assert_eq!(keys.layout_key(), "/tandem/prod-1/layout");
        assert_eq!(
            keys.load_subject(Role::Prefill, "p0").unwrap(),
            "tandem.prod-1.load.prefill.p0"
        );
        assert_eq!(keys.kv_subject("d_0").unwrap(), "tandem.prod-1.kv.d_0");
        assert_eq!(
            keys.load_wildcard(Role::Decode),
            "tandem.prod-1.load.decode.*"
        );
        assert_eq!(keys.kv_wildcard(), "tandem.prod-1.kv.*");
    }

    #[test]
    fn reserved_characters_cannot_add_levels_tokens_or_wildcards() {
        let keys = ClusterKeys::new("c.l/u*s>ter").unwrap();
        for name in HOSTILE {
            let key = keys.node_key(Role::Prefill, name).unwrap();
            // root, "tandem", cluster, "nodes", role, node: exactly 6 levels.
            assert_eq!(key.split('/').count(), 6, "{key}");
            let subject = keys.load_subject(Role::Prefill, name).unwrap();
            assert_eq!(subject.split('.').count(), 5, "{subject}");
            assert!(
                !subject.contains('*') && !subject.contains('>'),
                "{subject}"
            );
            let kv = keys.kv_subject(name).unwrap();
            assert_eq!(kv.split('.').count(), 4, "{kv}");
        }
    }

    #[test]
    fn keys_and_subjects_parse_back_to_role_and_node_id() {
        let keys = ClusterKeys::new("a.b").unwrap();
        for name in HOSTILE {
            for role in Role::ALL {
                let key = keys.node_key(role, name).unwrap();
                assert_eq!(keys.parse_node_key(&key).unwrap(), (role, name.to_string()));
                let subject = keys.load_subject(role, name).unwrap();
                assert_eq!(
                    keys.parse_load_subject(&subject).unwrap(),
                    (role, name.to_string())
                );
            }
            assert_eq!(
                keys.parse_kv_subject(&keys.kv_subject(name).unwrap())
                    .unwrap(),
                name
            );
        }
    }

    #[test]
    fn distinct_names_get_distinct_addresses() {
        let keys = ClusterKeys::new("c").unwrap();
        let mut seen = std::collections::HashSet::new();
        for name in HOSTILE.iter().chain(["a%2Eb", "a_b", "A.B"].iter()) {
            assert!(
                seen.insert(keys.node_key(Role::Decode, name).unwrap()),
                "{name} collided"
            );
        }
    }

    #[test]
    fn a_cluster_prefix_never_covers_another_cluster() {
        let a = ClusterKeys::new("a").unwrap();
        let ab = ClusterKeys::new("ab").unwrap();
        let a_slash_b = ClusterKeys::new("a/b").unwrap();
        for other in [&ab, &a_slash_b] {
            assert!(
                !other.nodes_prefix().starts_with(&a.nodes_prefix()),
                "{other:?}"
            );
            let key = other.node_key(Role::Decode, "n").unwrap();
            assert!(a.parse_node_key(&key).is_err(), "{key}");
        }
    }

    #[test]
    fn empty_names_are_refused() {
        assert!(matches!(
            ClusterKeys::new(""),
            Err(ClusterError::InvalidName {
                what: "cluster",
                ..
            })
        ));
        let keys = ClusterKeys::new("c").unwrap();
        assert!(matches!(
            keys.node_key(Role::Decode, ""),
            Err(ClusterError::InvalidName {
                what: "node id",
                ..
            })
        ));
    }

    #[test]
    fn non_canonical_or_foreign_addresses_are_refused() {
        let keys = ClusterKeys::new("c").unwrap();
        for bad in [
            "/tandem/c/nodes/decode/a%2eb", // lower-case hex
            "/tandem/c/nodes/decode/%41",   // escaped unreserved char
            "/tandem/c/nodes/decode/a.b",   // raw reserved char
            "/tandem/c/nodes/decode/%4",    // truncated
            "/tandem/c/nodes/decode/a/b",   // extra level
            "/tandem/c/nodes/router/a",     // unknown role
            "/tandem/c/nodes/decode/",      // empty node id
            "/tandem/c/nodes/decode/%FF",   // not UTF-8
            "/tandem/d/nodes/decode/a",     // other cluster
        ] {
            assert!(
                matches!(
                    keys.parse_node_key(bad),
                    Err(ClusterError::MalformedAddress { .. })
                ),
                "{bad} parsed"
            );
        }
        assert!(keys.parse_load_subject("tandem.c.load.decode.a.b").is_err());
        assert!(keys.parse_load_subject("tandem.c.load.decode").is_err());
        assert!(keys.parse_load_subject("tandem.d.load.decode.a").is_err());
        assert!(keys.parse_kv_subject("tandem.c.kv.a.b").is_err());
        assert!(keys.parse_kv_subject("tandem.c.load.decode.a").is_err());
    }
}
