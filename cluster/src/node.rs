//! What a node says about itself: [`Role`], [`NodeInfo`], and the cluster's [`ClusterLayout`].
//!
//! `NodeInfo` is stored as JSON at the node's etcd key (see [`keys`](crate::keys)). Readers
//! must tolerate unknown fields (serde's default) so a newer node can add fields without
//! breaking older routers. Fingerprints are written as 16 hex digits, the way logs print them.
//!
//! # Invariants
//! - A registered `NodeInfo` has passed [`NodeInfo::validate`]: a non-empty node id and gRPC
//!   address, and `layout_fingerprint == layout.fingerprint()`.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tandem_kv_layout::KvLayout;

use crate::error::ClusterError;

/// What a node does in the disaggregated pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs prompts and pushes their KV blocks to a decode node.
    Prefill,
    /// Receives KV blocks and generates tokens.
    Decode,
}

impl Role {
    /// Every role, in a fixed order.
    pub const ALL: [Role; 2] = [Role::Prefill, Role::Decode];

    /// A stable lowercase name, used in keys, subjects, metric labels and flags.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = ClusterError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            _ => Err(ClusterError::InvalidName {
                what: "role",
                value: s.to_string(),
                reason: "expected `prefill` or `decode`",
            }),
        }
    }
}

/// Where a node is in its life (docs/ARCHITECTURE.md, "A node's life"), published in its
/// record. Only `Serving` nodes get work.
///
/// ```text
///  starting → warming → serving → draining → gone (record deleted, lease revoked)
///   (engine     (forward pass,   (routed)   (no new work; running
///    loading)    KV self-check)              streams finish or migrate)
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Registered while loading (not used by the nodes today: they register once loaded).
    Starting,
    /// Model loaded and answering; running its warm-up checks. Not routed.
    Warming,
    /// Takes work. (Records written before states existed read as serving.)
    #[default]
    Serving,
    /// Finishing what it runs; takes nothing new. Then it leaves.
    Draining,
}

impl NodeState {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Starting => "starting",
            NodeState::Warming => "warming",
            NodeState::Serving => "serving",
            NodeState::Draining => "draining",
        }
    }
}

/// One node's registration record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Unique within (cluster, role); any non-empty string (it is percent-encoded in keys).
    pub node_id: String,
    /// What the node does.
    pub role: Role,
    /// Where its gRPC service listens, e.g. `http://10.0.0.5:50051` (opaque to this crate).
    pub grpc_addr: String,
    /// Where peers reach its KV-transfer endpoint(s), in the transport's own address syntax
    /// (opaque to this crate; empty for a node that only sends).
    pub kv_transfer_addrs: Vec<String>,
    /// The shape of its paged KV cache.
    pub layout: KvLayout,
    /// `layout.fingerprint()`, stored so readers need not recompute it (checked at register).
    #[serde(with = "hex_u64")]
    pub layout_fingerprint: u64,
    /// Total KV blocks the node holds.
    pub capacity_blocks: u64,
    /// True while the node finishes its running requests and takes no new ones (kept beside
    /// `state` for readers that predate it: `state == Draining` sets it).
    pub draining: bool,
    /// Where the node is in its life; only `Serving` nodes are routed.
    #[serde(default)]
    pub state: NodeState,
    /// Software version of the node binary.
    pub version: String,
    /// When the node process started, Unix milliseconds.
    pub started_at_unix_ms: u64,
    /// Where its Prometheus `/metrics` answers, e.g. `http://10.0.0.5:9100/metrics` (empty: none;
    /// records written before this field existed read as empty).
    #[serde(default)]
    pub metrics_url: String,
}

impl NodeInfo {
    /// A not-draining node started now, with the fingerprint computed from `layout`, this
    /// crate's version and no KV-transfer address (add them with
    /// [`NodeInfo::with_kv_transfer_addr`]).
    pub fn new(
        node_id: impl Into<String>,
        role: Role,
        grpc_addr: impl Into<String>,
        layout: KvLayout,
        capacity_blocks: u64,
    ) -> Self {
        Self {
            node_id: node_id.into(),
            role,
            grpc_addr: grpc_addr.into(),
            kv_transfer_addrs: Vec::new(),
            layout_fingerprint: layout.fingerprint(),
            layout,
            capacity_blocks,
            draining: false,
            state: NodeState::Serving,
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at_unix_ms: unix_ms_now(),
            metrics_url: String::new(),
        }
    }

    /// Sets the metrics URL.
    pub fn with_metrics_url(mut self, url: impl Into<String>) -> Self {
        self.metrics_url = url.into();
        self
    }

    /// Adds a KV-transfer address.
    pub fn with_kv_transfer_addr(mut self, addr: impl Into<String>) -> Self {
        self.kv_transfer_addrs.push(addr.into());
        self
    }

    /// Starts the record in `state` (a node registers `Warming`, then serves).
    pub fn with_state(mut self, state: NodeState) -> Self {
        self.state = state;
        self.draining = state == NodeState::Draining;
        self
    }

    /// Whether a router may send this node new work.
    pub fn accepts_work(&self) -> bool {
        !self.draining && self.state == NodeState::Serving
    }

    /// Checks the fields that registration relies on.
    pub fn validate(&self) -> Result<(), ClusterError> {
        let invalid = |field, reason: &str| ClusterError::InvalidNodeInfo {
            node_id: self.node_id.clone(),
            field,
            reason: reason.to_string(),
        };
        if self.node_id.is_empty() {
            return Err(invalid("node_id", "is empty"));
        }
        if self.grpc_addr.is_empty() {
            return Err(invalid("grpc_addr", "is empty"));
        }
        let computed = self.layout.fingerprint();
        if self.layout_fingerprint != computed {
            return Err(invalid(
                "layout_fingerprint",
                &format!(
                    "is {:016x} but the layout's fingerprint is {computed:016x}",
                    self.layout_fingerprint
                ),
            ));
        }
        Ok(())
    }
}

/// The nodes of one role, by node id: what [`Discovery::watch`](crate::Discovery::watch) keeps
/// current.
pub type NodeView = BTreeMap<String, NodeInfo>;

/// The KV layout a cluster's nodes share, stored at the cluster's layout key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterLayout {
    /// `layout.fingerprint()`.
    #[serde(with = "hex_u64")]
    pub fingerprint: u64,
    /// The layout itself (for log lines that show what differs).
    pub layout: KvLayout,
    /// The node whose registration last wrote this record.
    pub set_by: String,
}

impl ClusterLayout {
    /// The record `info`'s registration writes.
    pub fn of(info: &NodeInfo) -> Self {
        Self {
            fingerprint: info.layout_fingerprint,
            layout: info.layout,
            set_by: info.node_id.clone(),
        }
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Serializes a `u64` as 16 lower-case hex digits.
mod hex_u64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        u64::from_str_radix(&s, 16).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_layout::KvDtype;

    fn layout() -> KvLayout {
        KvLayout::new(30, 3, 64, 16, KvDtype::F16, 7).unwrap()
    }

    #[test]
    fn node_info_round_trips_through_json_with_hex_fingerprint() {
        let info = NodeInfo::new("d0", Role::Decode, "http://127.0.0.1:1", layout(), 512)
            .with_kv_transfer_addr("tcp://127.0.0.1:2");
        let json = serde_json::to_string(&info).unwrap();
        assert!(
            json.contains(&format!("\"{:016x}\"", layout().fingerprint())),
            "{json}"
        );
        assert!(json.contains("\"role\":\"decode\""), "{json}");
        let back: NodeInfo = serde_json::from_str(&json).unwrap();
        assert_eq!(back, info);
    }

    #[test]
    fn unknown_fields_from_newer_nodes_are_ignored() {
        let info = NodeInfo::new("p0", Role::Prefill, "http://a", layout(), 1);
        let mut value = serde_json::to_value(&info).unwrap();
        value["gpu_model"] = serde_json::json!("H200");
        let back: NodeInfo = serde_json::from_value(value).unwrap();
        assert_eq!(back, info);
    }

    #[test]
    fn validate_refuses_a_fingerprint_that_does_not_match_the_layout() {
        let mut info = NodeInfo::new("p0", Role::Prefill, "http://a", layout(), 1);
        info.validate().unwrap();
        info.layout_fingerprint ^= 1;
        assert!(matches!(
            info.validate(),
            Err(ClusterError::InvalidNodeInfo {
                field: "layout_fingerprint",
                ..
            })
        ));
        let empty = NodeInfo::new("", Role::Prefill, "http://a", layout(), 1);
        assert!(matches!(
            empty.validate(),
            Err(ClusterError::InvalidNodeInfo {
                field: "node_id",
                ..
            })
        ));
    }

    #[test]
    fn roles_parse_from_their_names_only() {
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>().unwrap(), role);
        }
        assert!("Decode".parse::<Role>().is_err());
        assert!("router".parse::<Role>().is_err());
    }
}
