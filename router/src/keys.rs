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
//!   ```
//!
//! Only hashes are kept in memory. A presented key is hashed and compared against every
//! entry in constant time (no early exit, so timing reveals nothing about near misses).

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::RouterError;

/// Who is calling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyIdentity {
    /// The key's id (`anonymous` when authentication is off).
    pub id: Arc<str>,
    /// Whether the key may read every key's usage.
    pub admin: bool,
}

impl KeyIdentity {
    /// The caller when authentication is off.
    pub fn anonymous() -> Self {
        KeyIdentity {
            id: Arc::from(ANONYMOUS),
            admin: true,
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
}

/// The accepted API keys; empty means no authentication.
#[derive(Clone, Debug, Default)]
pub struct ApiKeys {
    entries: Vec<Entry>,
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
                    }
                })
                .collect(),
        }
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
            });
        }
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
            let eq = e.sha256.iter().zip(&h).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0;
            if eq && found.is_none() {
                found = Some(e);
            }
        }
        found
            .map(|e| KeyIdentity {
                id: Arc::clone(&e.id),
                admin: e.admin,
            })
            .ok_or(RouterError::Unauthenticated)
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
        assert!(matches!(keys.check(None), Err(RouterError::Unauthenticated)));
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
            ("[[key]]\nid = \"a\"\nkey = \"x\"\n[[key]]\nid = \"a\"\nkey = \"y\"\n", "used twice"),
            ("[[key]]\nid = \"a\"\nkey = \"x\"\nrole = \"boss\"\n", "unknown field"),
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
    fn operator_keys_get_ids_from_their_hash_and_no_keys_means_anonymous() {
        let keys = ApiKeys::new(["sk-test".to_string()]);
        let id = keys.check(Some("Bearer sk-test")).unwrap();
        assert!(id.id.starts_with("key-") && id.id.len() == 12 && id.admin);
        assert_eq!(ApiKeys::default().check(None).unwrap(), KeyIdentity::anonymous());
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
