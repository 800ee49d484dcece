//! `--config FILE`: flag values from a TOML file, layered under env vars and flags.
//!
//! The file's keys are the flags' long names, with `-` or `_` (`kv-transport = "tcp"`,
//! `etcd_endpoints = ["http://a:2379", "http://b:2379"]`). Tables are flattened, so a file may
//! group keys (`[engine]`, `[cluster]`) however it likes; the group names carry no meaning. An
//! unknown key is an error naming it (a typo must not silently fall back to a default).
//!
//! Precedence is flag > env > file > default: a file value is turned into a flag placed
//! *before* the real arguments (so a repeated flag on the command line overrides it), and is
//! skipped when the flag's environment variable is set. Cost: one extra clap parse at startup.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use clap::error::ErrorKind;
use clap::{ArgAction, CommandFactory, FromArgMatches};

use crate::env_names::TANDEM_CONFIG;

/// Parses `argv` (program name first) into `T`, layering the `--config` file (or
/// `$TANDEM_CONFIG`) under env vars and flags. Errors (including `--help`) are clap errors:
/// call `.exit()` on them in a binary.
pub fn parse_layered<T: CommandFactory + FromArgMatches>(
    argv: Vec<OsString>,
) -> Result<T, clap::Error> {
    let mut cmd = T::command().args_override_self(true);
    let path =
        config_path(&argv).or_else(|| std::env::var_os(TANDEM_CONFIG).filter(|p| !p.is_empty()));
    let argv = match path {
        None => argv,
        Some(path) => {
            let file_args = file_flags(&cmd, Path::new(&path))
                .map_err(|msg| cmd.error(ErrorKind::InvalidValue, msg))?;
            let mut out = Vec::with_capacity(argv.len() + file_args.len());
            let mut it = argv.into_iter();
            out.extend(it.next());
            out.extend(file_args);
            out.extend(it);
            out
        }
    };
    let matches = cmd.try_get_matches_from_mut(argv)?;
    T::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
}

/// The value of `--config PATH` / `--config=PATH` on the command line, if any.
fn config_path(argv: &[OsString]) -> Option<OsString> {
    let mut it = argv.iter().skip(1);
    while let Some(a) = it.next() {
        if a == OsStr::new("--config") {
            return it.next().cloned();
        }
        if let Some(rest) = a.to_str().and_then(|s| s.strip_prefix("--config=")) {
            return Some(rest.into());
        }
    }
    None
}

/// The flags a config file stands for, in file order; a message naming the problem otherwise.
fn file_flags(cmd: &clap::Command, path: &Path) -> Result<Vec<OsString>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| format!("config file {}: {e}", path.display()))?;
    let mut pairs = Vec::new();
    flatten(&table, &mut pairs);
    let mut out = Vec::new();
    for (key, value) in pairs {
        let long = key.replace('_', "-");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()) && long != "config")
            .ok_or_else(|| {
                format!(
                    "config file {}: unknown key `{key}` (no flag --{long})",
                    path.display()
                )
            })?;
        if arg
            .get_env()
            .is_some_and(|env| std::env::var_os(env).is_some())
        {
            continue; // the environment outranks the file
        }
        let flag = format!("--{long}");
        match value {
            toml::Value::Boolean(b) if matches!(arg.get_action(), ArgAction::SetTrue) => {
                if *b {
                    out.push(flag.into());
                }
            }
            toml::Value::Table(_) => unreachable!("tables are flattened"),
            v => out.push(format!("{flag}={}", scalar(v, key, path)?).into()),
        }
    }
    Ok(out)
}

fn flatten<'a>(table: &'a toml::Table, out: &mut Vec<(&'a str, &'a toml::Value)>) {
    for (k, v) in table {
        match v {
            toml::Value::Table(t) => flatten(t, out),
            v => out.push((k.as_str(), v)),
        }
    }
}

fn scalar(v: &toml::Value, key: &str, path: &Path) -> Result<String, String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Datetime(d) => d.to_string(),
        toml::Value::Array(items) => {
            let parts: Result<Vec<_>, _> = items.iter().map(|i| scalar(i, key, path)).collect();
            parts?.join(",")
        }
        toml::Value::Table(_) => {
            return Err(format!(
                "config file {}: `{key}` cannot be a table here",
                path.display()
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NodeArgs;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        node: NodeArgs,
    }

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!(
            "tandem-node-cfg-{}-{name}.toml",
            std::process::id()
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("node")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect()
    }

    #[test]
    fn file_values_fill_in_and_flags_override_them() {
        let p = write(
            "layer",
            "cluster = \"from-file\"\nkv_transport = \"tcp\"\n[engine]\nkv-blocks = 64\nno_prefix_caching = true\n\
             [cluster_section]\netcd_endpoints = [\"http://a:1\", \"http://b:2\"]\n",
        );
        let cli: Cli = parse_layered(argv(&[
            "--config",
            p.to_str().unwrap(),
            "--cluster",
            "from-flag",
        ]))
        .unwrap();
        let a = cli.node;
        assert_eq!(a.cluster.cluster, "from-flag", "a flag beats the file");
        assert_eq!(a.listen.kv_transport, crate::config::TransportChoice::Tcp);
        assert_eq!(a.engine.kv_blocks, Some(64));
        assert!(a.engine.no_prefix_caching);
        assert_eq!(a.cluster.etcd_endpoints, ["http://a:1", "http://b:2"]);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn an_unknown_key_is_an_error_naming_it() {
        let p = write("typo", "kv_transprot = \"tcp\"\n");
        let err = parse_layered::<Cli>(argv(&[&format!("--config={}", p.display())])).unwrap_err();
        assert!(err.to_string().contains("kv_transprot"), "{err}");
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn without_a_file_parsing_is_plain_clap() {
        let cli: Cli = parse_layered(argv(&["--cluster", "c1"])).unwrap();
        assert_eq!(cli.node.cluster.cluster, "c1");
        assert!(parse_layered::<Cli>(argv(&["--no-such-flag"])).is_err());
    }
}
