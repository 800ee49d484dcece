//! API keys: who is calling. A key authenticates a request and names the caller with a key
//! *id* (never the secret), which travels with the request into the usage ledger, the
//! per-key metrics and the request's span.
//!
//! Sources:
//! - `--api-key SECRET` (repeatable, `TANDEM_API_KEYS`): operator keys, admin, with the id
//!   `key-` + the first 8 hex digits of the secret's SHA-256;
//! - `--api-keys-file PATH`: a TOML file of named keys, secrets stored as given or already
//!   hashed:
//!   ```toml
//!   [[key]]
//!   id = "team-search"          # the name usage is reported under
//!   sha256 = "9f86d081884c..."  # hex SHA-256 of the secret (or: key = "sk-...")
//!   admin = false               # admin keys may read /v1/usage of every key
//!   requests_per_second = 5     # limits, each optional, held across every router
//!   tokens_per_minute = 20000   #   (prompt + output tokens)
//!   max_concurrent_requests = 4 #   (see `ratelimit`)
//!   ```
//!
//! The file is read again on SIGHUP and when it changes ([`ApiKeys::reload`]); a file that
//! does not parse leaves the keys loaded before in place (the error names the line).
//!
//! Only hashes are kept in memory. A presented key is hashed and compared against every
//! entry in constant time (no early exit, so timing reveals nothing about near misses).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tandem_cluster::KeyLimits;

use crate::error::RouterError;

/// Who is calling.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyIdentity {
    /// The key's id (`anonymous` when authentication is off).
    pub id: Arc<str>,
    /// Whether the key may read every key's usage.
    pub admin: bool,
    /// The key's limits (none set: unlimited).
    pub limits: KeyLimits,
}

impl KeyIdentity {
    /// The caller when authentication is off.
    pub fn anonymous() -> Self {
        KeyIdentity {
            id: Arc::from(ANONYMOUS),
            admin: true,
            limits: KeyLimits::default(),
        }
    }
}

/// The key id of requests made with authentication off.
pub const ANONYMOUS: &str = "anonymous";

#[derive(Clone, Debug)]
struct Entry {
    id: Arc<str>,
    sha256: [u8; 32],
    admin: bool,
    limits: KeyLimits,
}

/// The accepted API keys; empty means no authentication.
#[derive(Clone, Debug, Default)]
pub struct ApiKeys {
    entries: Vec<Entry>,
    /// How many leading entries are operator keys (the rest came from `file`).
    operator: usize,
    /// The key file, read again by [`ApiKeys::reload`].
    file: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    #[serde(default)]
    key: Vec<FileEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    id: String,
    key: Option<String>,
    sha256: Option<String>,
    #[serde(default)]
    admin: bool,
    requests_per_second: Option<f64>,
    tokens_per_minute: Option<u64>,
    max_concurrent_requests: Option<u32>,
}

fn sha256(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl ApiKeys {
    /// Operator keys (admin), ids derived from their hashes (none: every request is accepted).
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        Self {
            entries: keys
                .into_iter()
                .filter(|k| !k.is_empty())
                .map(|k| {
                    let h = sha256(&k);
                    Entry {
                        id: Arc::from(format!("key-{}", &hex(&h)[..8])),
                        sha256: h,
                        admin: true,
                        limits: KeyLimits::default(),
                    }
                })
                .collect::<Vec<_>>(),
            operator: 0,
            file: None,
        }
        .counted()
    }

    fn counted(mut self) -> Self {
        self.operator = self.entries.len();
        self
    }

    /// The key file these keys were read from, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// The same operator keys with the key file read again. Errors (the file's keys stay as
    /// they were) name the file and, for syntax errors, the line.
    pub fn reload(&self) -> Result<Self, RouterError> {
        let Some(file) = &self.file else {
            return Ok(self.clone());
        };
        let operator = ApiKeys {
            entries: self.entries[..self.operator].to_vec(),
            operator: self.operator,
            file: None,
        };
        operator.with_file(file)
    }

    /// Adds the keys of a key file (see the module docs). Errors name the file and the entry.
    pub fn with_file(mut self, path: &Path) -> Result<Self, RouterError> {
        let invalid = |reason: String| RouterError::Config {
            field: "api-keys-file",
            value: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| invalid(e.to_string()))?;
        let file: KeyFile = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        for (n, e) in file.key.into_iter().enumerate() {
            let at = |what: &str| invalid(format!("[[key]] #{} (id {:?}): {what}", n + 1, e.id));
            if e.id.is_empty() || e.id == ANONYMOUS {
                return Err(at("id must be non-empty and not `anonymous`"));
            }
            if self.entries.iter().any(|x| *x.id == *e.id) {
                return Err(at("id is used twice"));
            }
            let limits = KeyLimits {
                requests_per_second: e.requests_per_second,
                tokens_per_minute: e.tokens_per_minute,
                max_concurrent_requests: e.max_concurrent_requests,
            };
            if limits
                .requests_per_second
                .is_some_and(|r| !(r.is_finite() && r > 0.0))
            {
                return Err(at("requests_per_second must be a positive number"));
            }
            if limits.tokens_per_minute == Some(0) || limits.max_concurrent_requests == Some(0) {
                return Err(at(
                    "tokens_per_minute and max_concurrent_requests must be positive (omit a limit for none)",
                ));
            }
            let h = match (&e.key, &e.sha256) {
                (Some(k), None) if !k.is_empty() => sha256(k),
                (None, Some(h)) => {
                    let bytes: Option<Vec<u8>> = (0..h.len())
                        .step_by(2)
                        .map(|i| h.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
                        .collect();
                    match bytes.and_then(|b| <[u8; 32]>::try_from(b).ok()) {
                        Some(a) => a,
                        None => return Err(at("sha256 must be 64 hex digits")),
                    }
                }
                _ => return Err(at("give exactly one of `key` and `sha256`")),
            };
            self.entries.push(Entry {
                id: Arc::from(e.id.as_str()),
                sha256: h,
                admin: e.admin,
                limits,
            });
        }
        self.file = Some(path.to_path_buf());
        Ok(self)
    }

    /// Whether authentication is on.
    pub fn enabled(&self) -> bool {
        !self.entries.is_empty()
    }

    /// Whether `id` names a configured key (or `anonymous` with authentication off).
    pub fn knows(&self, id: &str) -> bool {
        if self.entries.is_empty() {
            return id == ANONYMOUS;
        }
        self.entries.iter().any(|e| &*e.id == id)
    }

    /// Every key id, in configuration order.
    pub fn ids(&self) -> Vec<String> {
        self.entries.iter().map(|e| e.id.to_string()).collect()
    }

    /// Checks an `Authorization` value (`Bearer <key>`, or the bare key) and names the caller.
    pub fn check(&self, authorization: Option<&str>) -> Result<KeyIdentity, RouterError> {
        if self.entries.is_empty() {
            return Ok(KeyIdentity::anonymous());
        }
        let presented = authorization
            .map(str::trim)
            .map(|v| v.strip_prefix("Bearer ").unwrap_or(v).trim())
            .ok_or(RouterError::Unauthenticated)?;
        let h = sha256(presented);
        // Compare with every entry in full, whatever matches, so timing reveals nothing.
        let mut found: Option<&Entry> = None;
        for e in &self.entries {
            let eq = e
                .sha256
                .iter()
                .zip(&h)
                .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                == 0;
            if eq && found.is_none() {
                found = Some(e);
            }
        }
        found
            .map(|e| KeyIdentity {
                id: Arc::clone(&e.id),
                admin: e.admin,
                limits: e.limits,
            })
            .ok_or(RouterError::Unauthenticated)
    }
}

/// How often the key file's modification time is checked.
pub const KEY_FILE_POLL: Duration = Duration::from_secs(1);

/// Reloads the router's key file on SIGHUP and when its modification time or size changes,
/// until the router is gone. A failed reload is logged (file, line, what is wrong) and
/// counted; the keys before stay in place.
pub async fn watch_file(router: crate::pipeline::WeakRouter) {
    let stamp = |path: &Path| {
        std::fs::metadata(path)
            .ok()
            .map(|m| (m.modified().ok(), m.len()))
    };
    let Some(path) = router
        .upgrade()
        .and_then(|r| r.api_keys().file().map(Path::to_path_buf))
    else {
        return;
    };
    let mut seen = stamp(&path);
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let mut tick = tokio::time::interval(KEY_FILE_POLL);
    loop {
        if router.upgrade().is_none() {
            return;
        }
        #[cfg(unix)]
        let hangup = async {
            match hup.as_mut() {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hangup = std::future::pending::<Option<()>>();
        let why = tokio::select! {
            _ = hangup => "SIGHUP",
            _ = tick.tick() => {
                let now = stamp(&path);
                if now == seen {
                    continue;
                }
                seen = now;
                "the file changed"
            }
        };
        let Some(router) = router.upgrade() else {
            return;
        };
        match router.reload_api_keys() {
            Ok(n) => tracing::info!(file = %path.display(), keys = n, why, "API key file reloaded"),
            Err(error) => {
                tracing::error!(file = %path.display(), why, %error, "API key file not reloaded; the keys loaded before stay in place")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_names_callers_and_keeps_only_hashes() {
        let dir = std::env::temp_dir().join(format!("tandem-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("keys.toml");
        let hashed = hex(&sha256("sk-b"));
        std::fs::write(
            &f,
            format!(
                "[[key]]\nid = \"team-a\"\nkey = \"sk-a\"\n\n[[key]]\nid = \"ops\"\nsha256 = \"{hashed}\"\nadmin = true\n"
            ),
        )
        .unwrap();
        let keys = ApiKeys::default().with_file(&f).unwrap();
        let a = keys.check(Some("Bearer sk-a")).unwrap();
        assert_eq!((&*a.id, a.admin), ("team-a", false));
        let b = keys.check(Some("sk-b")).unwrap();
        assert_eq!((&*b.id, b.admin), ("ops", true));
        assert!(matches!(
            keys.check(Some("Bearer sk-c")),
            Err(RouterError::Unauthenticated)
        ));
        assert!(matches!(
            keys.check(None),
            Err(RouterError::Unauthenticated)
        ));
        assert!(keys.knows("team-a") && !keys.knows("team-z"));
        assert!(!format!("{keys:?}").contains("sk-a"), "no secret in memory");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_key_files_are_refused_naming_the_entry() {
        let dir = std::env::temp_dir().join(format!("tandem-keys-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (text, needle) in [
            ("[[key]]\nid = \"a\"\n", "exactly one of"),
            ("[[key]]\nid = \"a\"\nsha256 = \"zz\"\n", "64 hex"),
            (
                "[[key]]\nid = \"a\"\nkey = \"x\"\n[[key]]\nid = \"a\"\nkey = \"y\"\n",
                "used twice",
            ),
            (
                "[[key]]\nid = \"a\"\nkey = \"x\"\nrole = \"boss\"\n",
                "unknown field",
            ),
            (
                "[[key]]\nid = \"a\"\nkey = \"x\"\nrequests_per_second = -1\n",
                "positive number",
            ),
            (
                "[[key]]\nid = \"a\"\nkey = \"x\"\nmax_concurrent_requests = 0\n",
                "must be positive",
            ),
            ("[[key]\nid = \"a\"\n", "line 1"),
        ] {
            let f = dir.join("k.toml");
            std::fs::write(&f, text).unwrap();
            match ApiKeys::default().with_file(&f) {
                Err(RouterError::Config { field, reason, .. }) => {
                    assert_eq!(field, "api-keys-file");
                    assert!(reason.contains(needle), "{reason}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn limits_come_with_the_key_and_a_reload_keeps_operator_keys() {
        let dir = std::env::temp_dir().join(format!("tandem-keys-limits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("keys.toml");
        std::fs::write(
            &f,
            "[[key]]\nid = \"a\"\nkey = \"sk-a\"\nrequests_per_second = 2.5\ntokens_per_minute = 100\n",
        )
        .unwrap();
        let keys = ApiKeys::new(["sk-op".to_string()]).with_file(&f).unwrap();
        let a = keys.check(Some("sk-a")).unwrap();
        assert_eq!(
            a.limits,
            KeyLimits {
                requests_per_second: Some(2.5),
                tokens_per_minute: Some(100),
                max_concurrent_requests: None,
            }
        );
        assert!(keys.check(Some("sk-op")).unwrap().limits.is_unlimited());
        std::fs::write(&f, "[[key]]\nid = \"b\"\nkey = \"sk-b\"\n").unwrap();
        let reloaded = keys.reload().unwrap();
        assert!(reloaded.check(Some("sk-b")).is_ok());
        assert!(
            reloaded.check(Some("sk-a")).is_err(),
            "a key removed from the file is gone"
        );
        assert!(reloaded.check(Some("sk-op")).is_ok(), "operator keys stay");
        std::fs::write(&f, "[[key]\n").unwrap();
        assert!(keys.reload().is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn operator_keys_get_ids_from_their_hash_and_no_keys_means_anonymous() {
        let keys = ApiKeys::new(["sk-test".to_string()]);
        let id = keys.check(Some("Bearer sk-test")).unwrap();
        assert!(id.id.starts_with("key-") && id.id.len() == 12 && id.admin);
        assert_eq!(
            ApiKeys::default().check(None).unwrap(),
            KeyIdentity::anonymous()
        );
    }

    #[test]
    fn api_keys_accept_bearer_or_bare_keys_and_refuse_others() {
        let keys = ApiKeys::new(["k1".to_string(), "secret-2".to_string()]);
        assert!(keys.check(Some("Bearer secret-2")).is_ok());
        assert!(keys.check(Some("k1")).is_ok());
        assert!(matches!(
            keys.check(Some("Bearer k2")),
            Err(RouterError::Unauthenticated)
        ));
        assert!(matches!(
            keys.check(None),
            Err(RouterError::Unauthenticated)
        ));
        assert!(ApiKeys::default().check(None).is_ok());
    }
}
