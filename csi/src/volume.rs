//! A volume as the kubelet asks for it: its attributes and secret checked into what `batchfs mount`
//! takes, and the record of a published volume the plugin keeps in its state directory (so that a
//! plugin started again answers a publish it already did as done, and refuses one that conflicts).

use crate::proto::{volume_capability, NodePublishVolumeRequest};
use batchfs_mount::options::MountOptions;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tonic::Status;

/// The dataset's URL, as `batchfs mount` takes it (`http://server:7878/imagenet`).
pub const ATTR_URL: &str = "url";
/// The mount's options, the `-o` string of `batchfs mount` (`batch_size=256,cache=8G`).
pub const ATTR_OPTIONS: &str = "options";
/// The node-publish secret's key holding the server's bearer token.
pub const SECRET_TOKEN: &str = "token";
/// The prefix of what the kubelet adds to a volume's context (pod name, ephemeral, ...): not attributes.
const KUBELET_PREFIX: &str = "csi.storage.k8s.io/";

/// A volume to publish: what the request asked for, checked.
#[derive(Debug, Clone)]
pub struct Volume {
    pub id: String,
    pub target: PathBuf,
    pub url: String,
    /// The `options` attribute as given (empty when absent).
    pub options: String,
    pub token: Option<String>,
}

/// A published volume, as kept in the state directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub volume_id: String,
    pub target: PathBuf,
    pub url: String,
    pub options: String,
    /// A digest of the token the volume was published with (never the token itself), to tell a publish
    /// with another secret apart.
    pub token_digest: Option<String>,
}

/// Where a volume's `cache_dir` must be, under the plugin's state directory, and its `ca_file`.
pub const CACHE_DIRS: &str = "cache";
pub const CA_FILES: &str = "ca";

/// Refuses the options of `options` that name a path of the node, but for a `cache_dir` under
/// `STATE/cache/` and a `ca_file` under `STATE/ca/`, which the node's administrator owns. A volume's
/// attributes are a pod author's to write (an inline volume's are the pod's own), and the mount runs as
/// root in the holder's container, with the kubelet's directory in view: a `token_file` would send any file
/// there (another pod's secret) to any server as a token, a `log_file` or `energy_log` append to any file,
/// and a `cache_dir`'s eviction remove files under it. The token comes from the node-publish secret, the
/// log goes to the plugin's own file.
pub fn node_paths(options: &MountOptions, state: &Path) -> Result<(), NodePath> {
    let forbidden = [
        ("token_file", options.token_file.is_some(), "the token comes from the node-publish secret (key \"token\")"),
        ("log_file", options.log_file.is_some(), "the mount logs to the plugin's file for it"),
        ("energy_log", options.energy_log.is_some(), "not offered to volumes"),
    ];
    if let Some(&(key, _, why)) = forbidden.iter().find(|f| f.1) {
        return Err(NodePath::Forbidden { key, why });
    }
    let within = |key: &'static str, path: &Option<PathBuf>, under: &str| match path {
        Some(p) if !confined(p, &state.join(under)) => {
            Err(NodePath::Outside { key, path: p.clone(), root: state.join(under) })
        }
        _ => Ok(()),
    };
    within("cache_dir", &options.cache_dir, CACHE_DIRS)?;
    within("ca_file", &options.ca_file, CA_FILES)
}

/// A path of the node a volume's options may not name ([`node_paths`]).
#[derive(Debug, thiserror::Error)]
pub enum NodePath {
    #[error("{key} names a file of the node, which a volume may not: {why}")]
    Forbidden { key: &'static str, why: &'static str },
    #[error(
        "{key} {} is not under {}: a volume's {key} is a path there, which the node's administrator owns",
        path.display(),
        root.display()
    )]
    Outside { key: &'static str, path: PathBuf, root: PathBuf },
}

/// Whether `path` is strictly below `root`, as written: absolute, no `..` (nor `.`) component.
fn confined(path: &Path, root: &Path) -> bool {
    use std::path::Component;
    let plain = path.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    plain && path.is_absolute() && path != root && path.starts_with(root)
}

/// A caller's mistake in a request: `INVALID_ARGUMENT`, with what to fix.
fn invalid(message: String) -> Status {
    Status::invalid_argument(message)
}

impl Volume {
    /// The volume `req` asks to publish, checked: a volume id, an absolute target path, a mount (not block)
    /// capability, a valid `url` and `options` (parsed by the mount's own parser), nothing unknown, and no
    /// path of the node but under the plugin's state directory `state` ([`node_paths`]).
    pub fn from_request(req: &NodePublishVolumeRequest, state: &Path) -> Result<(Volume, MountOptions), Status> {
        if req.volume_id.is_empty() {
            return Err(invalid("volume_id is missing".into()));
        }
        let target = target_path(&req.target_path)?;
        let capability =
            req.volume_capability.as_ref().ok_or_else(|| invalid("volume_capability is missing".into()))?;
        match capability.access_type {
            Some(volume_capability::AccessType::Mount(_)) => {}
            Some(volume_capability::AccessType::Block(_)) => {
                return Err(invalid("batchfs volumes are filesystems: a block volume cannot be published".into()))
            }
            None => return Err(invalid("volume_capability has no access type (mount)".into())),
        }
        let context = &req.volume_context;
        let unknown: Vec<&str> = context
            .keys()
            .map(String::as_str)
            .filter(|k| *k != ATTR_URL && *k != ATTR_OPTIONS && !k.starts_with(KUBELET_PREFIX))
            .collect();
        if !unknown.is_empty() {
            return Err(invalid(format!(
                "unknown volume attributes {unknown:?} of volume {:?}: a batchfs volume takes {ATTR_URL:?} and \
                 {ATTR_OPTIONS:?}",
                req.volume_id
            )));
        }
        let url = context.get(ATTR_URL).filter(|u| !u.is_empty()).ok_or_else(|| {
            invalid(format!(
                "volume {:?} has no {ATTR_URL:?} attribute (the dataset's URL, http(s)://host:port/DATASET)",
                req.volume_id
            ))
        })?;
        batchfs_mount::client::parse_url(url)
            .map_err(|e| invalid(format!("volume {:?}: attribute {ATTR_URL:?}: {e}", req.volume_id)))?;
        let options = context.get(ATTR_OPTIONS).cloned().unwrap_or_default();
        let mut parsed = MountOptions::default();
        if !options.is_empty() {
            parsed
                .apply_list(&options)
                .map_err(|e| invalid(format!("volume {:?}: attribute {ATTR_OPTIONS:?}: {e}", req.volume_id)))?;
        }
        node_paths(&parsed, state)
            .map_err(|e| invalid(format!("volume {:?}: attribute {ATTR_OPTIONS:?}: {e}", req.volume_id)))?;
        if !parsed.supervise {
            return Err(invalid(format!(
                "volume {:?}: supervise=false: the plugin's mounts are supervised (their upgrades and the plugin's \
                 restarts rely on it)",
                req.volume_id
            )));
        }
        let unknown: Vec<&str> = req.secrets.keys().map(String::as_str).filter(|k| *k != SECRET_TOKEN).collect();
        if !unknown.is_empty() {
            return Err(invalid(format!(
                "unknown keys {unknown:?} in the node-publish secret of volume {:?}: it holds {SECRET_TOKEN:?}",
                req.volume_id
            )));
        }
        let token = req.secrets.get(SECRET_TOKEN).map(|t| t.trim().to_owned()).filter(|t| !t.is_empty());
        let volume = Volume { id: req.volume_id.clone(), target, url: url.clone(), options, token };
        Ok((volume, parsed))
    }

    /// The record of this volume once published.
    pub fn record(&self) -> Record {
        Record {
            volume_id: self.id.clone(),
            target: self.target.clone(),
            url: self.url.clone(),
            options: self.options.clone(),
            token_digest: self.token.as_deref().map(digest),
        }
    }

    /// The `-o` string the mount runs with: the volume's options, `allow_other` (the pod's processes are
    /// not the plugin's user), the token file when the secret gave a token, and the plugin's log file for
    /// it (the options name none: [`node_paths`]).
    pub fn mount_options(&self, token_file: Option<&Path>, log_file: Option<&Path>) -> String {
        let mut parts: Vec<String> = Vec::new();
        if !self.options.is_empty() {
            parts.push(self.options.clone());
        }
        parts.push("allow_other".into());
        if let Some(file) = token_file {
            parts.push(format!("token_file={}", file.display()));
        }
        if let Some(file) = log_file {
            parts.push(format!("log_file={}", file.display()));
        }
        parts.join(",")
    }
}

/// An absolute, non-empty target path (`INVALID_ARGUMENT` otherwise).
pub fn target_path(path: &str) -> Result<PathBuf, Status> {
    if path.is_empty() {
        return Err(invalid("target_path is missing".into()));
    }
    let path = PathBuf::from(path);
    if !path.is_absolute() {
        return Err(invalid(format!("target_path {} is not absolute", path.display())));
    }
    Ok(path)
}

/// A digest of a secret, to compare two without keeping either (CRC32C of each half of the bytes, with
/// the length: a publish with another token is told apart, the token is not recoverable from it).
fn digest(secret: &str) -> String {
    let bytes = secret.as_bytes();
    let (a, b) = bytes.split_at(bytes.len() / 2);
    format!("{}-{:08x}{:08x}", bytes.len(), crc32c::crc32c(a), crc32c::crc32c(b))
}

/// The plugin's state directory: a record per published target, the token files of the mounts (`0600`,
/// read by the mount's workers each time one starts) and their logs (the mounts are daemons).
#[derive(Debug, Clone)]
pub struct State {
    dir: PathBuf,
}

impl State {
    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The state in `dir`, made if missing.
    pub fn open(dir: &Path) -> std::io::Result<State> {
        for sub in ["volumes", "tokens", "logs"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join("tokens"), std::fs::Permissions::from_mode(0o700))?;
        Ok(State { dir: dir.to_owned() })
    }

    /// A file name for `target`: its CRC32C and its last component, readable and unique enough (the
    /// record holds the whole path, and is checked against it).
    fn key(target: &Path) -> String {
        let name: String = target
            .file_name()
            .map(|n| n.to_string_lossy().chars().filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c)).collect())
            .unwrap_or_default();
        format!("{:08x}-{}", crc32c::crc32c(target.as_os_str().as_encoded_bytes()), name)
    }

    fn record_path(&self, target: &Path) -> PathBuf {
        self.dir.join("volumes").join(format!("{}.json", Self::key(target)))
    }

    /// Where the token of the volume at `target` is kept while it is published.
    pub fn token_path(&self, target: &Path) -> PathBuf {
        self.dir.join("tokens").join(Self::key(target))
    }

    /// Where the mount at `target` logs (a volume's options may not name a `log_file`).
    pub fn log_path(&self, target: &Path) -> PathBuf {
        self.dir.join("logs").join(format!("{}.log", Self::key(target)))
    }

    /// The record of the volume published at `target`, if any.
    pub fn get(&self, target: &Path) -> std::io::Result<Option<Record>> {
        match std::fs::read(self.record_path(target)) {
            Ok(bytes) => {
                let record: Record = serde_json::from_slice(&bytes).map_err(std::io::Error::other)?;
                Ok(Some(record).filter(|r| r.target == target))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every record (a plugin started again upgrades their mounts).
    pub fn all(&self) -> std::io::Result<Vec<Record>> {
        let mut records = Vec::new();
        for entry in std::fs::read_dir(self.dir.join("volumes"))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "json") {
                match std::fs::read(&path).map(|b| serde_json::from_slice::<Record>(&b)) {
                    Ok(Ok(r)) => records.push(r),
                    _ => tracing::warn!(path = %path.display(), "an unreadable volume record: skipped"),
                }
            }
        }
        Ok(records)
    }

    /// Keeps `record` (written whole to a temporary name, then renamed into place).
    pub fn put(&self, record: &Record) -> std::io::Result<()> {
        let bytes = serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?;
        batchfs::atomic::write(&self.record_path(&record.target), &bytes, 0o644)
    }

    /// Writes the token of the volume at `target` (`0600`), returning its path.
    pub fn put_token(&self, target: &Path, token: &str) -> std::io::Result<PathBuf> {
        let path = self.token_path(target);
        batchfs::atomic::write(&path, token.as_bytes(), 0o600)?;
        Ok(path)
    }

    /// Forgets the volume at `target`: its record, its token and its log.
    pub fn remove(&self, target: &Path) -> std::io::Result<()> {
        for path in [self.record_path(target), self.token_path(target), self.log_path(target)] {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }
}

/// The attributes of a record, for messages (never the token).
pub fn describe(r: &Record) -> String {
    let attrs: BTreeMap<&str, &str> = [(ATTR_URL, r.url.as_str()), (ATTR_OPTIONS, r.options.as_str())].into();
    format!("volume {:?} {attrs:?}", r.volume_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::volume_capability::{AccessType, BlockVolume, MountVolume};
    use crate::proto::VolumeCapability;

    fn request(context: &[(&str, &str)], secrets: &[(&str, &str)]) -> NodePublishVolumeRequest {
        let map = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        NodePublishVolumeRequest {
            volume_id: "vol".into(),
            target_path: "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/data".into(),
            volume_capability: Some(VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: None,
            }),
            readonly: true,
            volume_context: map(context),
            secrets: map(secrets),
            ..Default::default()
        }
    }

    fn error(req: &NodePublishVolumeRequest) -> String {
        let status = Volume::from_request(req, Path::new("/state")).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        status.message().to_owned()
    }

    #[test]
    fn a_volume_is_its_url_options_and_token_and_the_mount_gets_allow_other_and_the_token_file() {
        let req = request(
            &[
                ("url", "http://s:7878/imagenet"),
                ("options", "batch_size=256,cache=8G"),
                ("csi.storage.k8s.io/pod.name", "p"),
            ],
            &[("token", " t0ken\n")],
        );
        let (v, o) = Volume::from_request(&req, Path::new("/state")).unwrap();
        assert_eq!((v.url.as_str(), v.token.as_deref()), ("http://s:7878/imagenet", Some("t0ken")));
        assert_eq!((o.plan.batch_size, o.cache), (256, 8 << 30));
        assert_eq!(
            v.mount_options(Some(Path::new("/state/tokens/x")), Some(Path::new("/state/logs/x.log"))),
            "batch_size=256,cache=8G,allow_other,token_file=/state/tokens/x,log_file=/state/logs/x.log"
        );
        let bare = Volume::from_request(&request(&[("url", "http://s:1/d")], &[]), Path::new("/state")).unwrap().0;
        assert_eq!(bare.mount_options(None, None), "allow_other");
        let r = v.record();
        assert!(!serde_json::to_string(&r).unwrap().contains("t0ken"), "no token in a record");
        let other = Volume { token: Some("other".into()), ..v.clone() };
        assert_ne!(other.record(), r, "another token is another publish");
    }

    #[test]
    fn bad_requests_say_what_to_fix() {
        let url = ("url", "http://s:1/d");
        assert!(
            error(&NodePublishVolumeRequest { volume_id: String::new(), ..request(&[url], &[]) }).contains("volume_id")
        );
        assert!(error(&NodePublishVolumeRequest { target_path: "rel/x".into(), ..request(&[url], &[]) })
            .contains("not absolute"));
        let block = VolumeCapability { access_type: Some(AccessType::Block(BlockVolume {})), access_mode: None };
        assert!(error(&NodePublishVolumeRequest { volume_capability: Some(block), ..request(&[url], &[]) })
            .contains("block"));
        assert!(error(&request(&[], &[])).contains("\"url\""));
        assert!(error(&request(&[("url", "s3://b/d")], &[])).contains("url"));
        assert!(error(&request(&[url, ("opts", "x")], &[])).contains("opts"));
        assert!(error(&request(&[url, ("options", "bogus=1")], &[])).contains("bogus"));
        assert!(error(&request(&[url, ("options", "supervise=false")], &[])).contains("supervise"));
        assert!(error(&request(&[url], &[("password", "x")])).contains("password"));
    }

    /// A volume's options name no file of the node but a cache directory and CA file where the node's
    /// administrator keeps them: a pod author's `token_file` sent any file the holder sees (another pod's
    /// secret) to any server, and a `log_file` appended to any file.
    #[test]
    fn a_volume_names_no_path_of_the_node_but_under_the_plugin_s_state() {
        let url = ("url", "http://s:1/d");
        for (options, says) in [
            ("token_file=/var/lib/kubelet/pods/other/secret", "token_file names a file of the node"),
            ("log_file=/etc/profile", "log_file names a file of the node"),
            ("energy_log=/tmp/e", "energy_log names a file of the node"),
            ("cache_dir=/var/lib/kubelet", "cache_dir /var/lib/kubelet is not under /state/cache"),
            ("cache_dir=/state", "not under /state/cache"),
            ("cache_dir=/state/cache", "not under /state/cache"),
            ("cache_dir=/state/cache/../tokens", "not under /state/cache"),
            ("cache_dir=state/cache/x", "not under /state/cache"),
            ("ca_file=/etc/shadow", "ca_file /etc/shadow is not under /state/ca"),
        ] {
            let e = error(&request(&[url, ("options", options)], &[]));
            assert!(e.contains(says), "{options}: {e}");
        }
        let fine = request(&[url, ("options", "cache_dir=/state/cache/imagenet,ca_file=/state/ca/site.pem")], &[]);
        let (_, o) = Volume::from_request(&fine, Path::new("/state")).unwrap();
        assert_eq!(o.cache_dir.as_deref(), Some(Path::new("/state/cache/imagenet")));
    }

    #[test]
    fn records_and_tokens_are_kept_per_target_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let state = State::open(dir.path()).unwrap();
        let (v, _) =
            Volume::from_request(&request(&[("url", "http://s:1/d")], &[("token", "t")]), Path::new("/state")).unwrap();
        assert_eq!(state.get(&v.target).unwrap(), None);
        state.put(&v.record()).unwrap();
        let token = state.put_token(&v.target, "t").unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&token).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(state.get(&v.target).unwrap(), Some(v.record()));
        assert_eq!(state.all().unwrap(), vec![v.record()]);
        // Another target's record is not this one's, even under the same file name's last component.
        assert_eq!(state.get(Path::new("/elsewhere/data")).unwrap(), None);
        state.remove(&v.target).unwrap();
        state.remove(&v.target).unwrap();
        assert_eq!((state.get(&v.target).unwrap(), token.exists()), (None, false));
    }
}
