//! The store behind an object dataset: its URL parsed, its client built from the settings, and its
//! listing, with the errors a user can fix told apart ([`ObjectError`]). A store may also be given
//! ready-made ([`Bucket::of_store`]): the unit tests give an in-memory one.

use super::{ObjectError, ObjectLimits};
use batchfs::index::{ETag, ShardInfo};
use futures_util::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// A bucket (and prefix) of a store, and how to reach it.
pub struct Bucket {
    pub store: Arc<dyn ObjectStore>,
    /// `s3://BUCKET/PREFIX`, without a trailing `/`.
    pub url: String,
    pub bucket: String,
    /// The prefix, without a trailing `/` (empty: the whole bucket).
    pub prefix: String,
    /// Where the store is, for messages.
    pub endpoint: String,
}

/// `(bucket, prefix)` of `s3://BUCKET/PREFIX` (or `s3a://`).
fn parse_url(url: &str) -> Result<(&str, &str), ObjectError> {
    let rest = url.strip_prefix("s3://").or_else(|| url.strip_prefix("s3a://"));
    let (bucket, prefix) = match rest {
        Some(rest) => rest.split_once('/').unwrap_or((rest, "")),
        None => return Err(ObjectError::BadUrl { url: url.to_owned() }),
    };
    if bucket.is_empty() {
        return Err(ObjectError::BadUrl { url: url.to_owned() });
    }
    // What S3 and the stores like it take (AWS's older names had capitals and `_`); another character
    // made the S3 client panic as it signed the first request.
    if !bucket.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(ObjectError::BadBucket { url: url.to_owned(), bucket: bucket.to_owned() });
    }
    Ok((bucket, prefix.trim_end_matches('/')))
}

/// The object named `key` (a listing's name, or a prefix joined to one): `object_store`'s `From<&str>`
/// percent-encodes what it deems unsafe in a key (every non-ASCII character, `%`, `?`, `#`, `~`, ...), so
/// `c/aüb.jpg`, listed as it is, was asked for as `c/a%C3%BCb.jpg`, an object that is not there (the
/// dataset refused as changed). Parsed, the key is taken as it is; a key it refuses (an empty component:
/// `a//b`) is taken as before (`a/b`).
fn object_path(key: &str) -> ObjectPath {
    ObjectPath::parse(key).unwrap_or_else(|_| ObjectPath::from(key))
}

/// Refuses an endpoint that is no `http(s)://HOST[:PORT]` (the S3 client panicked on one as it signed
/// the first request: `127.0.0.1:9000`, an empty one), and a plain-HTTP one the client would refuse
/// (its error, "URL scheme is not allowed", said nothing of `allow_http`).
fn check_endpoint(url: &str, endpoint: &str, allow_http: bool) -> Result<(), ObjectError> {
    let bad = || ObjectError::BadEndpoint { url: url.to_owned(), endpoint: endpoint.to_owned() };
    let parsed = reqwest::Url::parse(endpoint).map_err(|_| bad())?;
    match parsed.scheme() {
        _ if parsed.host_str().is_none_or(str::is_empty) => Err(bad()),
        "https" => Ok(()),
        "http" if allow_http => Ok(()),
        "http" => Err(ObjectError::HttpNotAllowed { url: url.to_owned(), endpoint: endpoint.to_owned() }),
        _ => Err(bad()),
    }
}

/// `object_store`'s S3 keys that are switches (as its `AmazonS3ConfigKey` names them): a value of one that
/// is none (`allow_http = "maybe"`) was refused as the client was built, in words that named the dataset
/// but not the key (`failed to parse "maybe" as boolean`), or, for `allow_http`, taken for false and the
/// endpoint then refused as plain HTTP.
const SWITCHES: [&str; 14] = [
    "allow_http",
    "allow_invalid_certificates",
    "http1_only",
    "http2_only",
    "http2_keep_alive_while_idle",
    "randomize_addresses",
    "aws_imdsv1_fallback",
    "aws_virtual_hosted_style_request",
    "aws_s3_express",
    "aws_unsigned_payload",
    "aws_skip_signature",
    "aws_disable_tagging",
    "aws_request_payer",
    "aws_sse_bucket_key_enabled",
];

/// A switch's value as `object_store` reads it: `true`, `1`, `on`, `yes`, `y`, or `false`, `0`, `off`,
/// `no`, `n`, in any case (no space around).
fn switch(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" | "y" => Some(true),
        "0" | "false" | "off" | "no" | "n" => Some(false),
        _ => None,
    }
}

/// Refuses a switch of `builder` (from the environment, or `settings`) whose value is none, naming the key
/// as it was given: in `settings` (any of its spellings), else its `AWS_*` variable.
fn check_switches(
    url: &str,
    settings: &BTreeMap<String, String>,
    builder: &AmazonS3Builder,
) -> Result<(), ObjectError> {
    for name in SWITCHES {
        let key: AmazonS3ConfigKey = name.parse().expect("a switch of object_store's");
        let Some(value) = builder.get_config_value(&key).filter(|v| switch(v).is_none()) else { continue };
        let given = settings.keys().find(|k| k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>().ok() == Some(key));
        let (key, whence) = match given {
            Some(given) => (given.clone(), "in [dataset.s3]"),
            None => (format!("AWS_{}", name.trim_start_matches("aws_")).to_ascii_uppercase(), "in the environment"),
        };
        return Err(ObjectError::BadSwitch { url: url.to_owned(), key, value, whence });
    }
    Ok(())
}

/// The setting the S3 client refuses the value of (a duration, a number, a checksum's name...: its words
/// name the value, not the key), each tried alone; `None` where none is refused alone (the environment's).
fn refused_setting<'a>(bucket: &str, settings: &'a BTreeMap<String, String>) -> Option<(&'a String, &'a String)> {
    settings.iter().find(|(key, value)| {
        let Ok(key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() else { return false };
        AmazonS3Builder::new().with_bucket_name(bucket).with_config(key, value.as_str()).build().is_err()
    })
}

impl Bucket {
    /// The S3 client of `url`: the `AWS_*` environment, then `settings` (`object_store`'s S3 keys), with
    /// `limits`' timeouts and retries.
    pub fn connect(
        url: &str,
        settings: &BTreeMap<String, String>,
        limits: &ObjectLimits,
    ) -> Result<Bucket, ObjectError> {
        let (bucket, prefix) = parse_url(url)?;
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
        let ms = |d: Duration| format!("{}ms", d.as_millis().max(1));
        builder = builder.with_config("timeout".parse().expect("a client key"), ms(limits.timeout)).with_config(
            "connect_timeout".parse().expect("a client key"),
            ms(limits.timeout.min(Duration::from_secs(10))),
        );
        for (key, value) in settings {
            let parsed: AmazonS3ConfigKey = key
                .to_ascii_lowercase()
                .parse()
                .map_err(|_| ObjectError::BadSetting { url: url.to_owned(), key: key.clone() })?;
            builder = builder.with_config(parsed, value);
        }
        let retry = object_store::RetryConfig {
            backoff: object_store::BackoffConfig::default(),
            max_retries: 10,
            retry_timeout: limits.retry_for,
        };
        builder = builder.with_retry(retry);
        check_switches(url, settings, &builder)?;
        let given = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
        if let Some(endpoint) = &given {
            let allow = AmazonS3ConfigKey::Client(object_store::ClientConfigKey::AllowHttp);
            let allow_http = builder.get_config_value(&allow).and_then(|v| switch(&v)) == Some(true);
            check_endpoint(url, endpoint, allow_http)?;
        }
        if asks_metadata_refused(&builder, std::env::var("AWS_EC2_METADATA_DISABLED").ok().as_deref()) {
            return Err(ObjectError::MetadataOff { url: url.to_owned() });
        }
        let endpoint = given.unwrap_or_else(|| "the AWS endpoint of the bucket's region".to_owned());
        let store = builder.build().map_err(|e| match refused_setting(bucket, settings) {
            Some((key, value)) => ObjectError::BadValue {
                url: url.to_owned(),
                key: key.clone(),
                value: value.clone(),
                source: Box::new(e),
            },
            None => ObjectError::Config { url: url.to_owned(), source: Box::new(e) },
        })?;
        Ok(Bucket {
            store: Arc::new(store),
            url: url.trim_end_matches('/').to_owned(),
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            endpoint,
        })
    }

    /// `url` read from `store` as it is (no settings): for tests, with an in-memory store.
    pub fn of_store(url: &str, store: Arc<dyn ObjectStore>, endpoint: &str) -> Result<Bucket, ObjectError> {
        let (bucket, prefix) = parse_url(url)?;
        Ok(Bucket {
            store,
            url: url.trim_end_matches('/').to_owned(),
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            endpoint: endpoint.to_owned(),
        })
    }

    /// Where `path` (relative to the prefix) is in the bucket.
    pub fn location(&self, path: &str) -> ObjectPath {
        match self.prefix.is_empty() {
            true => object_path(path),
            false => object_path(&format!("{}/{path}", self.prefix)),
        }
    }

    /// The objects under the prefix (relative paths, sorted; hidden names, those with a component that
    /// starts with `.`, left out) with their sizes, modification times and ETags.
    pub async fn list(&self) -> Result<Vec<ShardInfo>, ObjectError> {
        let at = (!self.prefix.is_empty()).then(|| object_path(&self.prefix));
        let strip = if self.prefix.is_empty() { 0 } else { self.prefix.len() + 1 };
        // Each object as it comes: a page's metadata is dropped before the next page is read.
        let file = |meta: object_store::ObjectMeta| {
            let path = meta.location.as_ref().get(strip..)?;
            if path.is_empty() || path.split('/').any(|c| c.starts_with('.')) {
                return None;
            }
            let mtime_ns = meta.last_modified.timestamp_nanos_opt().unwrap_or(0);
            Some(ShardInfo {
                path: path.into(),
                size: meta.size,
                mtime_ns,
                etag: meta.e_tag.map(ETag::from).unwrap_or_default(),
                ..Default::default()
            })
        };
        let mut files: Vec<ShardInfo> = self
            .store
            .list(at.as_ref())
            .try_filter_map(|meta| std::future::ready(Ok(file(meta))))
            .try_collect()
            .await
            .map_err(|e| self.list_error(e))?;
        files.sort_by(|a, b| a.path.cmp(&b.path));
        let markers = drop_folder_markers(&mut files);
        if markers.empty > 0 {
            let markers = markers.empty;
            tracing::info!(url = %self.url, markers, "left out folder markers (empty objects named as a folder)");
        }
        if let Some((first, size)) = markers.with_bytes.first() {
            // Once a listing (an indexing): every class folder of a tree may have one.
            tracing::warn!(
                url = %self.url, bucket = %self.bucket, key = %self.location(first), bytes = size,
                objects = markers.with_bytes.len(),
                "left out objects with bytes named as a folder of other objects (a folder marker KEY/ written with \
                 content, or an object KEY beside KEY/...): a local copy holds a directory there, not a file"
            );
        }
        if files.is_empty() {
            return Err(self.nothing_under_prefix().await);
        }
        Ok(files)
    }

    /// [`Bucket::list`], asked again with backoff (from 100 ms, doubling to 2 s) while the store cannot be
    /// reached or answers with a server error and `retry_for` (`object_retry_for`) from the first try
    /// lasts: a store started beside the server may answer a while after it. A refusal (no bucket, no
    /// access, no credentials, nothing under the prefix, a request the store calls wrong) is said at once.
    pub async fn list_within(&self, retry_for: Duration) -> Result<Vec<ShardInfo>, ObjectError> {
        let now = tokio::time::Instant::now();
        let deadline = now.checked_add(retry_for).unwrap_or(now + Duration::from_secs(86_400 * 365));
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.list().await {
                Err(e) if passing(&e) && tokio::time::Instant::now() + backoff < deadline => {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    tracing::warn!(
                        url = %self.url, error = %e, retrying_for_s = left.as_secs(),
                        "listing the bucket failed: asking again while object_retry_for lasts"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                listed => return listed,
            }
        }
    }

    /// Why no object is under the prefix: it names an object itself (`s3://b/train/x.tfrecord`, where
    /// the dataset is `s3://b/train`), or nothing.
    async fn nothing_under_prefix(&self) -> ObjectError {
        use object_store::ObjectStoreExt;
        let an_object = !self.prefix.is_empty() && self.store.head(&object_path(&self.prefix)).await.is_ok();
        match an_object {
            true => ObjectError::AnObject {
                url: self.url.clone(),
                bucket: self.bucket.clone(),
                folder: self.prefix.rsplit_once('/').map_or("", |(folder, _)| folder).to_owned(),
            },
            false => ObjectError::Empty { url: self.url.clone() },
        }
    }

    /// What a failed listing means to the user, by the error's kind: `object_store`'s own, the HTTP
    /// client's (a connection or a timeout), or the S3 error code the store answered with.
    fn list_error(&self, source: object_store::Error) -> ObjectError {
        let (url, endpoint) = (self.url.clone(), self.endpoint.clone());
        let code = s3_code(&source);
        let http = http_kind(&source);
        let source = Box::new(source);
        use object_store::client::HttpErrorKind;
        match (source.as_ref(), code.as_deref(), http) {
            (object_store::Error::NotFound { .. }, ..) | (_, Some("NoSuchBucket"), _) => {
                ObjectError::NoBucket { url, bucket: self.bucket.clone(), endpoint, source }
            }
            (object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }, ..)
            | (_, Some("AccessDenied" | "InvalidAccessKeyId" | "SignatureDoesNotMatch"), _) => {
                ObjectError::Denied { url, endpoint, source }
            }
            // Without keys, object_store asks the instance metadata service: its failure is the answer.
            _ if asked_for_credentials(&source.to_string()) => ObjectError::NoCredentials { url, source },
            (_, _, Some(HttpErrorKind::Connect | HttpErrorKind::Timeout)) => {
                ObjectError::Unreachable { url, endpoint, source }
            }
            _ => ObjectError::List { url, source },
        }
    }
}

/// Whether the S3 client would ask the instance metadata service for credentials (signed requests, and
/// no keys, web identity or container credentials given) where `AWS_EC2_METADATA_DISABLED` (`disabled`,
/// as the AWS SDKs and CLI take it) says not to: `object_store` does not read that variable, and asked.
fn asks_metadata_refused(builder: &AmazonS3Builder, disabled: Option<&str>) -> bool {
    use AmazonS3ConfigKey as K;
    let given = |key: K| builder.get_config_value(&key).is_some();
    let unsigned = builder.get_config_value(&K::SkipSignature).and_then(|v| switch(&v)) == Some(true);
    let credentials = given(K::AccessKeyId)
        || given(K::SecretAccessKey)
        || (given(K::WebIdentityTokenFile) && given(K::RoleArn))
        || given(K::ContainerCredentialsRelativeUri)
        || (given(K::ContainerCredentialsFullUri) && given(K::ContainerAuthorizationTokenFile));
    disabled.is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) && !unsigned && !credentials
}

/// The address of EC2's instance metadata service, where object_store looks for credentials last.
const INSTANCE_METADATA: &str = "169.254.169.254";

/// Whether a failure's text is of the credentials' lookup (the instance metadata service, at its
/// address or at `AWS_METADATA_ENDPOINT`'s, by its API's paths; a credential provider's own error), not
/// of the store: it was said to be the store unreachable, "check AWS_ENDPOINT_URL".
fn asked_for_credentials(text: &str) -> bool {
    let metadata_api = ["/latest/api/token", "/latest/meta-data/"];
    text.contains(INSTANCE_METADATA)
        || metadata_api.iter().any(|path| text.contains(path))
        || text.to_ascii_lowercase().contains("credential")
}

/// The objects [`drop_folder_markers`] left out.
#[derive(Debug, Default, PartialEq)]
struct FolderMarkers {
    /// Empty ones: the markers tools write.
    empty: usize,
    /// Ones with bytes (path, size), in path order: a marker written with content, or an object `KEY`
    /// beside `KEY/...` (`object_store` lists both as `KEY`); warned of.
    with_bytes: Vec<(String, u64)>,
}

/// Leaves out the objects named as a folder of other objects: the "folder markers" (`class-0000/`) that
/// the S3 console's "Create folder", s3fs, rclone and Hadoop's s3a write, whose trailing `/`
/// `object_store` drops. Kept, each was a file of the folder's name that hid the folder's files from
/// `raw/` (a local copy of the tree holds a directory there). One with bytes is left out too, as a local
/// copy (`aws s3 sync`) leaves it out, but said: it was left out of `raw/` without a word, and its GET
/// (of `KEY`, where the object is `KEY/`) failed on S3.
fn drop_folder_markers(files: &mut Vec<ShardInfo>) -> FolderMarkers {
    let folders: std::collections::HashSet<&str> =
        files.iter().flat_map(|f| f.path.match_indices('/').map(|(at, _)| &f.path[..at])).collect();
    let marker: Vec<bool> = files.iter().map(|f| folders.contains(f.path.as_str())).collect();
    let mut markers = FolderMarkers::default();
    for (file, _) in files.iter().zip(&marker).filter(|(_, &m)| m) {
        match file.size {
            0 => markers.empty += 1,
            size => markers.with_bytes.push((file.path.to_string(), size)),
        }
    }
    let mut at = 0;
    files.retain(|_| {
        at += 1;
        !marker[at - 1]
    });
    markers
}

/// Whether a failed listing may pass if asked again: the store not reached (refused, timed out), a
/// request cut on its way, or an answer of a server error (5xx, `SlowDown`), not a refusal.
fn passing(e: &ObjectError) -> bool {
    use object_store::client::HttpErrorKind;
    match e {
        ObjectError::Unreachable { .. } => true,
        ObjectError::List { source, .. } => {
            let code = s3_code(source);
            let transient_code =
                matches!(code.as_deref(), Some("InternalError" | "ServiceUnavailable" | "SlowDown" | "RequestTimeout"));
            let kind = http_kind(source.as_ref());
            let cut =
                matches!(kind, Some(HttpErrorKind::Request | HttpErrorKind::Interrupted | HttpErrorKind::Timeout));
            transient_code || cut || server_status(source)
        }
        _ => false,
    }
}

/// Whether `e` carries an HTTP status of 5xx (`object_store` keeps it in a type of its own that it does
/// not export, whose debug form says `status: 503`).
fn server_status(e: &object_store::Error) -> bool {
    let text = format!("{e:?}");
    text.match_indices("status: 5").any(|(at, m)| {
        let digits = text.as_bytes().get(at + m.len()..at + m.len() + 2);
        digits.is_some_and(|d| d.iter().all(u8::is_ascii_digit))
    })
}

/// The kind of the HTTP client's error behind `e`, if one is.
fn http_kind(e: &(dyn std::error::Error + 'static)) -> Option<object_store::client::HttpErrorKind> {
    let mut at = Some(e);
    while let Some(e) = at {
        if let Some(http) = e.downcast_ref::<object_store::client::HttpError>() {
            return Some(http.kind());
        }
        at = e.source();
    }
    None
}

/// The S3 error code (`<Code>NoSuchBucket</Code>` of the store's answer) that `e` carries, if any:
/// `object_store` keeps the answer's body in its error but no type of its own for the code.
fn s3_code(e: &object_store::Error) -> Option<String> {
    let text = format!("{e:?}");
    let start = text.find("<Code>")? + "<Code>".len();
    let len = text[start..].find("</Code>")?;
    Some(text[start..start + len].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_locations_join_the_prefix() {
        assert_eq!(parse_url("s3://b/p/q/").unwrap(), ("b", "p/q"));
        assert_eq!(parse_url("s3a://b").unwrap(), ("b", ""));
        assert!(matches!(parse_url("s3:///p"), Err(ObjectError::BadUrl { .. })));
        assert!(matches!(parse_url("gs://b"), Err(ObjectError::BadUrl { .. })));
        let store = Arc::new(object_store::memory::InMemory::new());
        let b = Bucket::of_store("s3://b/data/", store.clone(), "memory").unwrap();
        assert_eq!((b.url.as_str(), b.location("x/y").as_ref()), ("s3://b/data", "data/x/y"));
        assert_eq!(Bucket::of_store("s3://b", store, "memory").unwrap().location("x").as_ref(), "x");
    }

    /// Bucket names and endpoints the S3 client would panic on, or refuse saying nothing of why, are
    /// refused at start, each naming what to fix.
    #[test]
    fn a_bad_bucket_name_or_endpoint_is_refused_naming_it() {
        for url in ["s3://da ta/x", "s3://a:b/x", "s3://user@data/x", "s3://ü/x"] {
            assert!(matches!(parse_url(url), Err(ObjectError::BadBucket { .. })), "{url}");
        }
        assert_eq!(parse_url("s3://My_old.bucket-1/p").unwrap(), ("My_old.bucket-1", "p"));
        for endpoint in ["127.0.0.1:9000", "", "localhost:9000", "ftp://h", "http://"] {
            let e = check_endpoint("s3://b", endpoint, true).unwrap_err();
            assert!(matches!(e, ObjectError::BadEndpoint { .. }), "{endpoint}: {e}");
        }
        let e = check_endpoint("s3://b", "http://127.0.0.1:9000", false).unwrap_err();
        assert!(e.to_string().contains("AWS_ALLOW_HTTP=true"), "{e}");
        check_endpoint("s3://b", "http://127.0.0.1:9000", true).unwrap();
        check_endpoint("s3://b", "https://s3.example.com", false).unwrap();
        // Through the settings, as a user gives them: an error, not a panic at the first request.
        let settings = |endpoint: &str| {
            [("endpoint", endpoint), ("allow_http", "true"), ("region", "us-east-1")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .into_iter()
                .collect::<BTreeMap<_, _>>()
        };
        let limits = ObjectLimits::of(&crate::config::ServerLimits::default(), 1 << 40);
        let e = Bucket::connect("s3://b/p", &settings("127.0.0.1:9000"), &limits).err().unwrap();
        assert!(matches!(e, ObjectError::BadEndpoint { .. }), "{e}");
        // A switch's value that is none: refused naming the key as given, the value and what is taken (it
        // was refused as a plain-HTTP endpoint, or by object_store's "failed to parse" naming no key).
        for (key, endpoint) in [("allow_http", "http://127.0.0.1:9000"), ("AWS_ALLOW_HTTP", "https://s3.example.com")] {
            let mut bad = settings(endpoint);
            bad.remove("allow_http");
            bad.insert(key.into(), "maybe".into());
            let e = Bucket::connect("s3://b/p", &bad, &limits).err().unwrap().to_string();
            let said = format!("s3://b/p: {key} = \"maybe\" (in [dataset.s3]) is no switch: give true or false");
            assert!(e.starts_with(&said) && e.contains("yes or no"), "{e}");
        }
        let mut bad = settings("https://s3.example.com");
        bad.insert("virtual_hosted_style_request".into(), " true".into());
        let e = Bucket::connect("s3://b/p", &bad, &limits).err().unwrap();
        assert!(matches!(&e, ObjectError::BadSwitch { key, .. } if key == "virtual_hosted_style_request"), "{e}");
        for value in ["TRUE", "1", "on", "Yes", "y"] {
            let mut good = settings("http://127.0.0.1:9000");
            good.insert("allow_http".into(), value.into());
            Bucket::connect("s3://b/p", &good, &limits).unwrap();
        }
        Bucket::connect("s3://b/p", &settings("http://127.0.0.1:9000"), &limits).unwrap();
        // A value of another kind the client refuses: named with its key (object_store's words name the
        // value alone: `failed to parse "soon" as Duration`).
        for (key, value) in [("timeout", "soon"), ("Pool_Max_Idle_Per_Host", "-1"), ("checksum_algorithm", "md4")] {
            let mut bad = settings("http://127.0.0.1:9000");
            bad.insert(key.into(), value.into());
            let e = Bucket::connect("s3://b/p", &bad, &limits).err().unwrap();
            assert!(matches!(&e, ObjectError::BadValue { key: k, .. } if k == key), "{e}");
            let said = format!("s3://b/p: {key} = \"{value}\" in [dataset.s3] is refused by the S3 client: ");
            assert!(e.to_string().starts_with(&said), "{e}");
        }
    }

    /// Keys as S3 takes them (any UTF-8 but control characters): a listed key is asked for as listed.
    /// `object_store`'s `Path::from` percent-encodes `ü`, `%`, `?`, `#`, `~`, ...: such objects were asked
    /// for under names that are not there.
    #[tokio::test]
    async fn keys_are_read_as_they_are_listed() {
        use object_store::ObjectStoreExt;
        let store = Arc::new(object_store::memory::InMemory::new());
        let keys = ["p/c/aüb.jpg", "p/c/100%.jpg", "p/c/a%20b", "p/c/q?#~\"*<{[^`|.jpg", "p/ü~/x"];
        for key in keys {
            store
                .put(&ObjectPath::parse(key).unwrap(), bytes::Bytes::from(key.as_bytes().to_vec()).into())
                .await
                .unwrap();
        }
        let bucket = Bucket::of_store("s3://b/p", store.clone(), "memory").unwrap();
        let listed = bucket.list().await.unwrap();
        assert_eq!(listed.len(), keys.len());
        for file in &listed {
            let got = store.get(&bucket.location(&file.path)).await.unwrap().bytes().await.unwrap();
            assert_eq!(&got[..], format!("p/{}", file.path).as_bytes());
        }
        // A prefix of such characters lists what is under it.
        let under = Bucket::of_store("s3://b/p/ü~", store, "memory").unwrap();
        assert_eq!(under.list().await.unwrap().len(), 1);
    }

    /// A store that answers nothing but `503 SlowDown` for its first `busy` (its listing after), on a
    /// loopback port: the listings it answered, and its address.
    async fn store_busy_for(busy: Duration) -> (Arc<std::sync::atomic::AtomicUsize>, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = format!("http://{}", listener.local_addr().unwrap());
        let (listed, until) = (Arc::new(std::sync::atomic::AtomicUsize::new(0)), std::time::Instant::now() + busy);
        let count = listed.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).await.unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let (status, body) = match std::time::Instant::now() < until {
                    true => ("503 Service Unavailable", "<Error><Code>SlowDown</Code><Message>wait</Message></Error>"),
                    false => {
                        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        (
                            "200 OK",
                            "<ListBucketResult><Name>b</Name><Prefix>p/</Prefix><KeyCount>1</KeyCount>\
                            <IsTruncated>false</IsTruncated><Contents><Key>p/a.tfrecord</Key>\
                            <LastModified>2026-12-07T00:00:00.000Z</LastModified>\
                            <ETag>\"0123456789abcdef0123456789abcdef\"</ETag><Size>10</Size>\
                            </Contents></ListBucketResult>",
                        )
                    }
                };
                let top = format!("HTTP/1.1 {status}\r\ncontent-type: application/xml\r\nconnection: close\r\n");
                let answer = format!("{top}content-length: {}\r\n\r\n{body}", body.len());
                let _ = conn.write_all(answer.as_bytes()).await;
            }
        });
        (listed, at)
    }

    fn bucket_at(endpoint: &str, retry_for: Duration) -> Bucket {
        let settings: BTreeMap<String, String> = [
            ("endpoint", endpoint),
            ("allow_http", "true"),
            ("access_key_id", "a"),
            ("secret_access_key", "b"),
            ("region", "us-east-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let limits = crate::ServerLimits { object_retry_for: retry_for, ..Default::default() };
        Bucket::connect("s3://b/p", &settings, &super::super::ObjectLimits::of(&limits, 1 << 30)).unwrap()
    }

    /// A store busy (`503`) past `object_store`'s own retries of a request (ten, about 5 s) is listed once
    /// it answers, while `object_retry_for` lasts (the server stopped at the first listing that failed);
    /// past `object_retry_for`, the error. A refusal is said at once.
    #[tokio::test]
    async fn a_listing_is_asked_again_while_object_retry_for_lasts() {
        let (listed, at) = store_busy_for(Duration::from_secs(8)).await;
        let started = std::time::Instant::now();
        let files = bucket_at(&at, Duration::from_secs(30)).list_within(Duration::from_secs(30)).await.unwrap();
        assert_eq!((files.len(), files[0].path.as_str(), files[0].size), (1, "a.tfrecord", 10));
        assert_eq!(listed.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(started.elapsed() >= Duration::from_secs(8), "listed only once the store answered");
        let (_, at) = store_busy_for(Duration::from_secs(3600)).await;
        let started = std::time::Instant::now();
        let e = bucket_at(&at, Duration::from_secs(2)).list_within(Duration::from_secs(2)).await.unwrap_err();
        assert!(matches!(e, ObjectError::List { .. }) && passing(&e), "{e}");
        assert!(started.elapsed() < Duration::from_secs(20), "given up once object_retry_for ended");
        // Refused at once: a bucket that is not there (the in-memory store's answer).
        let none = Bucket::of_store("s3://b/nothing", Arc::new(object_store::memory::InMemory::new()), "memory");
        let started = std::time::Instant::now();
        let e = none.unwrap().list_within(Duration::from_secs(30)).await.unwrap_err();
        assert!(matches!(e, ObjectError::Empty { .. }) && started.elapsed() < Duration::from_secs(5), "{e}");
    }

    /// `AWS_EC2_METADATA_DISABLED=true` without keys is `no credentials` at once (object_store asked the
    /// metadata service all the same); with keys, web identity or `skip_signature`, nothing is asked.
    #[test]
    fn metadata_disabled_without_credentials_is_said_at_once() {
        use AmazonS3ConfigKey as K;
        let bare = AmazonS3Builder::new().with_bucket_name("b");
        assert!(asks_metadata_refused(&bare, Some("true")) && asks_metadata_refused(&bare, Some("TRUE ")));
        assert!(!asks_metadata_refused(&bare, None) && !asks_metadata_refused(&bare, Some("false")));
        let keys = bare.clone().with_config(K::AccessKeyId, "a").with_config(K::SecretAccessKey, "b");
        assert!(!asks_metadata_refused(&keys, Some("true")));
        let unsigned = bare.clone().with_config(K::SkipSignature, "true");
        assert!(!asks_metadata_refused(&unsigned, Some("true")));
        let irsa =
            bare.clone().with_config(K::WebIdentityTokenFile, "/t").with_config(K::RoleArn, "arn:aws:iam::1:role/r");
        assert!(!asks_metadata_refused(&irsa, Some("true")));
        let e = ObjectError::MetadataOff { url: "s3://b/p".into() }.to_string();
        assert!(e.contains("no credentials") && e.contains("AWS_EC2_METADATA_DISABLED"), "{e}");
    }

    /// A dataset URL naming one object (`s3://b/train/x.tfrecord`) says so and names the prefix to give;
    /// a prefix with nothing under it is empty.
    #[tokio::test]
    async fn a_url_of_one_object_says_to_give_its_prefix() {
        use object_store::ObjectStoreExt;
        let store = Arc::new(object_store::memory::InMemory::new());
        store.put(&ObjectPath::from("train/x.tfrecord"), bytes::Bytes::from_static(b"x").into()).await.unwrap();
        let one = Bucket::of_store("s3://b/train/x.tfrecord", store.clone(), "memory").unwrap();
        let e = one.list().await.unwrap_err();
        assert!(e.to_string().contains("an object, not a prefix") && e.to_string().contains("s3://b/train)"), "{e}");
        let none = Bucket::of_store("s3://b/nothing", store, "memory").unwrap();
        assert!(matches!(none.list().await.unwrap_err(), ObjectError::Empty { .. }));
    }

    /// Folder markers (`c0/`, an empty object whose name `object_store` gives as `c0`) beside the folder's
    /// objects are left out: each was a file `c0` that hid the folder from `raw/`. An empty object that
    /// names no folder is a file, as on a disk.
    #[tokio::test]
    async fn folder_markers_are_left_out_of_a_listing() {
        use object_store::ObjectStoreExt;
        let store = Arc::new(object_store::memory::InMemory::new());
        for (key, bytes) in [
            ("p/c0/a.jpg", &b"jpeg"[..]),
            ("p/c0", b""),
            ("p/c0-x.jpg", b"x"),
            ("p/c1", b""),
            ("p/d/e/f", b"f"),
            ("p/d/e", b""),
        ] {
            store.put(&ObjectPath::from(key), bytes::Bytes::from_static(bytes).into()).await.unwrap();
        }
        let listed = Bucket::of_store("s3://b/p", store, "memory").unwrap().list().await.unwrap();
        let paths: Vec<&str> = listed.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["c0-x.jpg", "c0/a.jpg", "c1", "d/e/f"]);
    }

    /// A folder marker with bytes (`c0/` holding 6, beside `c0/a.jpg`; `object_store` lists it as `c0`) is
    /// left out as an empty one is, and said: it was kept as a file `c0`, which `raw/`'s folder `c0` hid,
    /// and whose GET (of `c0`, the object being `c0/`) failed on S3.
    #[tokio::test]
    async fn a_folder_marker_with_bytes_is_left_out_and_said() {
        use object_store::ObjectStoreExt;
        let store = Arc::new(object_store::memory::InMemory::new());
        for (key, bytes) in [("p/c0/a.jpg", &b"jpeg"[..]), ("p/c0", b"marker"), ("p/c1", b""), ("p/c1/b.jpg", b"b")] {
            store.put(&ObjectPath::from(key), bytes::Bytes::from_static(bytes).into()).await.unwrap();
        }
        let listed = Bucket::of_store("s3://b/p", store, "memory").unwrap().list().await.unwrap();
        let paths: Vec<&str> = listed.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["c0/a.jpg", "c1/b.jpg"]);
        // What is warned of: the one with bytes, by its path and size; the empty one only counted.
        let file = |path: &str, size| ShardInfo { path: path.into(), size, ..Default::default() };
        let mut files = vec![file("c0", 6), file("c0/a.jpg", 4), file("c1", 0), file("c1/b.jpg", 1), file("c2", 3)];
        let markers = drop_folder_markers(&mut files);
        assert_eq!(markers, FolderMarkers { empty: 1, with_bytes: vec![("c0".into(), 6)] });
        assert_eq!(files.len(), 3, "c2 names no folder: a file");
    }

    #[test]
    fn an_s3_error_code_is_read_from_the_answer() {
        let e = object_store::Error::Generic {
            store: "S3",
            source: "Client error with status 404 Not Found: <?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code>\
                     <Message>The specified bucket does not exist</Message></Error>"
                .into(),
        };
        assert_eq!(s3_code(&e).as_deref(), Some("NoSuchBucket"));
        let b = Bucket::of_store("s3://b", Arc::new(object_store::memory::InMemory::new()), "memory").unwrap();
        assert!(matches!(b.list_error(e), ObjectError::NoBucket { .. }));
        let other = object_store::Error::Generic { store: "S3", source: "a reset".into() };
        assert!(matches!(b.list_error(other), ObjectError::List { .. }));
        // No keys anywhere: object_store's last resort, the instance metadata service, refused.
        let metadata = "Error performing PUT http://169.254.169.254/latest/api/token in 1ms - 403 Forbidden";
        let none = object_store::Error::Generic { store: "S3", source: metadata.into() };
        let e = b.list_error(none);
        assert!(matches!(e, ObjectError::NoCredentials { .. }) && e.to_string().contains("no credentials"), "{e}");
        // The metadata service elsewhere (AWS_METADATA_ENDPOINT), down: still the credentials, not the store.
        let moved = "Error performing PUT http://127.0.0.1:19498/latest/api/token in 2ms: error sending request";
        let e = b.list_error(object_store::Error::Generic { store: "S3", source: moved.into() });
        assert!(matches!(e, ObjectError::NoCredentials { .. }), "{e}");
    }
}
