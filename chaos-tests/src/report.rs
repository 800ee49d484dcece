//! A drill's result row, and the table `tandem drill` prints.

use serde::Serialize;

/// What one drill saw. Every request sent is counted in exactly one of `ok`, `failed` and
/// `cancelled`; `garbled` counts, among the ok and cancelled ones, those whose text differs
/// from (or, hung up, is not a prefix of) the fault-free reference.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Row {
    /// The drill's name.
    pub drill: String,
    /// Requests sent.
    pub sent: usize,
    /// Answered in full.
    pub ok: usize,
    /// Ended with an error (after the client's retries).
    pub failed: usize,
    /// Answered, but not with the fault-free text.
    pub garbled: usize,
    /// Hung up by the drill's own clients (the disconnect storm).
    pub cancelled: usize,
    /// Retries the clients made (lost connections, cut answers, 429/503).
    pub retried: u32,
    /// Attempts the router itself repeated (retries, re-prefills, migrations: its
    /// `tandem_router_recoveries_total`), i.e. how much of the fault it absorbed.
    pub router_recoveries: u64,
    /// The longest a client waited for its next bytes, s.
    pub longest_stall_s: f64,
    /// From the fault to the first answer of a request sent after it, s (`None`: never).
    pub recovery_s: Option<f64>,
    /// KV blocks still used or reserved on the surviving nodes once the load ended (from the
    /// nodes' own accounting; `None`: a node could not be read).
    pub leaked_blocks: Option<u64>,
    /// Processes the cluster started that still ran after it stopped.
    pub processes_left: usize,
    /// 0 lost, 0 garbled, 0 leaked, nothing left behind, recovery within one lease TTL.
    pub target_met: bool,
    /// Why the target was missed, and the first errors seen.
    pub notes: Vec<String>,
}

/// The rows as an aligned text table, with each row's notes beneath it.
pub fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<17} {:>5} {:>5} {:>6} {:>7} {:>9} {:>7} {:>9} {:>9} {:>10} {:>7} {:>10} {:>6}\n",
        "drill",
        "sent",
        "ok",
        "failed",
        "garbled",
        "cancelled",
        "retried",
        "recovered",
        "stall (s)",
        "recov. (s)",
        "leaked",
        "procs left",
        "target"
    );
    for r in rows {
        let recovery = r.recovery_s.map_or("never".into(), |s| format!("{s:.1}"));
        let leaked = r.leaked_blocks.map_or("?".into(), |b| b.to_string());
        out.push_str(&format!(
            "{:<17} {:>5} {:>5} {:>6} {:>7} {:>9} {:>7} {:>9} {:>9.1} {:>10} {:>7} {:>10} {:>6}\n",
            r.drill,
            r.sent,
            r.ok,
            r.failed,
            r.garbled,
            r.cancelled,
            r.retried,
            r.router_recoveries,
            r.longest_stall_s,
            recovery,
            leaked,
            r.processes_left,
            if r.target_met { "met" } else { "MISSED" }
        ));
        for n in &r.notes {
            out.push_str(&format!("    {}: {n}\n", r.drill));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_every_column_and_flags_a_missed_target() {
        let row = Row {
            drill: "decode-kill".into(),
            sent: 10,
            ok: 9,
            failed: 1,
            garbled: 0,
            cancelled: 0,
            retried: 2,
            router_recoveries: 3,
            longest_stall_s: 1.25,
            recovery_s: None,
            leaked_blocks: Some(0),
            processes_left: 0,
            target_met: false,
            notes: vec!["1 request failed".into()],
        };
        let t = table(std::slice::from_ref(&row));
        assert!(t.lines().next().unwrap().contains("procs left"));
        assert!(t.contains("MISSED") && t.contains("never") && t.contains("1 request failed"));
        let json = serde_json::to_value(&row).unwrap();
        for field in [
            "sent",
            "ok",
            "failed",
            "garbled",
            "longest_stall_s",
            "recovery_s",
            "leaked_blocks",
            "processes_left",
        ] {
            assert!(json.get(field).is_some(), "{field}");
        }
    }
}
