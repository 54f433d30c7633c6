//! The HTTP/2 client: `connections` multiplexed connections to each server (made by `connect.rs`: TCP,
//! or TLS over a socket read ahead; spoken by `wire.rs`), every request routed by the servers' health
//! (`health.rs`). Bodies are received straight into their [`Sink`] with the CRC32C computed as they
//! arrive; the small replies (descriptions, manifests, listings, tables) are gathered whole, up to
//! [`REPLY_BYTES`]. A response that stalls or runs past its announced size is cut off.

use super::connect::{Connector, Stream};
use super::health::{Health, InFlight};
use super::recheck::{failed_span, Suspects};
use super::wire::{Ask, Got, KeepAlive, Reply, Target, Whole, Wire, INBOX};
use super::{BatchClient, Body, BodyFut, BoxFut, ClientError, Request, Sent, Sink};
use batchfs::api::{
    self, BatchQuery, DatasetInfo, ErrorBody, FileList, Manifest, RollingQuery, SampleTable, SlotTable,
};
use batchfs::encode::BatchFormat;
use bytes::Bytes;
use http::StatusCode;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where and how to reach the servers.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Base URLs (`http://host:port`), one per server holding the dataset.
    pub servers: Vec<String>,
    pub dataset: String,
    /// Plan options (the format is given per request).
    pub query: BatchQuery,
    pub token: Option<String>,
    /// HTTP/2 connections per server.
    pub connections: usize,
    /// PEM file of extra CA certificates for `https://` servers.
    pub ca_file: Option<PathBuf>,
    /// A response with no bytes for this long is abandoned (and retried).
    pub stall_timeout: Duration,
    /// A connection quiet this long is sent a PING, and ended if nothing answers within `stall_timeout`
    /// (zero: never).
    pub keepalive: Duration,
    pub connect_timeout: Duration,
    /// The largest DATA frame a server may send (SETTINGS_MAX_FRAME_SIZE). Each frame is read into a
    /// buffer of its size: above glibc's mmap threshold (256 KiB, see [`crate::sys`]) every one is a fresh
    /// mapping, faulted in page by page and unmapped again, which cost more than the copy of the bytes.
    pub frame_size: u32,
}

impl HttpConfig {
    /// What names this dataset in a node cache shared by mounts of other servers: the server the mount
    /// was given (its URL's, the first; `servers=` replicas are no part of it) and the dataset's name.
    pub fn cache_namespace(&self) -> String {
        format!("{} {}", self.servers.first().map_or("", String::as_str), self.dataset)
    }
}

/// Why a dataset's URL does not parse (the URL as given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("{0:?}: expected http(s)://host:port/DATASET")]
    Malformed(String),
    #[error("{0:?}: the scheme must be http or https")]
    Scheme(String),
    #[error("{0:?}: the URL names no dataset")]
    NoDataset(String),
    #[error("{0:?}: malformed dataset name")]
    DatasetName(String),
    #[error(
        "{0:?}: a user or password in the URL is not used (and /proc/mounts would show it): give the token in \
         token_file="
    )]
    Credentials(String),
    #[error(
        "{0:?}: a URL with a query or fragment (`?`, `#`): the URL is http(s)://host:port/DATASET (plan options \
         go in -o)"
    )]
    Query(String),
}

/// Refuses what a server's base URL `host` part (or a dataset URL's) must not hold: credentials, which
/// nothing would send and the mount table would show every user, and a query or fragment, which would
/// be taken for part of the name.
pub fn check_url_parts(url: &str) -> Result<(), UrlError> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host = rest.split('/').next().unwrap_or_default();
    if host.contains('@') {
        return Err(UrlError::Credentials(url.to_owned()));
    }
    if rest.contains(['?', '#']) {
        return Err(UrlError::Query(url.to_owned()));
    }
    Ok(())
}

/// Splits `http(s)://host:port/DATASET` into the server base URL and the dataset name.
pub fn parse_url(url: &str) -> Result<(String, String), UrlError> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| UrlError::Malformed(url.to_owned()))?;
    if scheme != "http" && scheme != "https" {
        return Err(UrlError::Scheme(url.to_owned()));
    }
    check_url_parts(url)?;
    let (host, dataset) = rest.split_once('/').ok_or_else(|| UrlError::NoDataset(url.to_owned()))?;
    let dataset = dataset.trim_end_matches('/');
    if host.is_empty() || dataset.is_empty() || dataset.contains('/') {
        return Err(UrlError::Malformed(url.to_owned()));
    }
    let dataset = api::percent_decode(dataset).ok_or_else(|| UrlError::DatasetName(url.to_owned()))?;
    Ok((format!("{scheme}://{host}"), dataset))
}

/// The most bytes a small reply (JSON, the sample table) may hold: a bound against a server that never
/// ends one, far above what any dataset needs.
pub const REPLY_BYTES: u64 = 1 << 30;

/// The HTTP/2 client.
pub struct HttpClient {
    config: HttpConfig,
    /// `connections` connections per server, server-major, each made when first needed and again after
    /// it ends.
    wires: Vec<tokio::sync::Mutex<Option<Arc<Wire>>>>,
    connector: Connector,
    next: AtomicUsize,
    /// Every server's health, which routes each request (see `client/health.rs`).
    health: Arc<Health>,
    /// Bytes of responses received, as they come ([`BatchClient::received`]).
    received: Arc<std::sync::atomic::AtomicU64>,
    /// The index of the dataset replies must be of ([`BatchClient::expect_index`]); unset: any.
    index_id: std::sync::OnceLock<Arc<str>>,
    /// The requests whose last body failed its checksum: their next attempt asks its server to recheck.
    suspects: Suspects,
}

impl HttpClient {
    /// Builds the clients; connects lazily.
    pub fn new(config: HttpConfig) -> anyhow::Result<Self> {
        let mut ca = None;
        if let Some(path) = &config.ca_file {
            let pem =
                std::fs::read(path).map_err(|e| anyhow::anyhow!("cannot read ca_file {}: {e}", path.display()))?;
            ca = Some(pem);
        }
        let connector = Connector::new(ca.as_deref(), config.connect_timeout).map_err(|e| match &config.ca_file {
            Some(path) => anyhow::anyhow!("ca_file {}: {e}", path.display()),
            None => anyhow::anyhow!("TLS: {e}"),
        })?;
        let health = Arc::new(Health::new(&config.servers));
        let lanes = config.servers.len() * config.connections.max(1);
        let wires = (0..lanes).map(|_| tokio::sync::Mutex::new(None)).collect();
        let (next, received) = (AtomicUsize::new(0), Default::default());
        let (index_id, suspects) = Default::default();
        Ok(HttpClient { config, wires, connector, next, health, received, index_id, suspects })
    }

    /// Every server's health (for `batchfs stats` and the metrics endpoint).
    pub fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    /// The server the health view picks for a request of a body of about `expect` bytes (`spread` rotates
    /// ties), or server `on` where given, after any rest it asked for, with the lane (of `wires`) it goes on.
    async fn route(&self, spread: usize, expect: u64, on: Option<usize>) -> (InFlight<'_>, usize, String) {
        let flight = match on {
            Some(server) => self.health.begin_on(server, expect),
            None => self.health.begin(spread, expect),
        };
        // Every server is out and this one, back soonest, rests after shedding load: as it asked.
        if let Some(rest) = self.health.resting(flight.server()) {
            tokio::time::sleep(rest).await;
        }
        let per = self.config.connections.max(1);
        let lane = flight.server() * per + self.next.fetch_add(1, Ordering::Relaxed) % per;
        let server = self.health.url(flight.server()).to_owned();
        (flight, lane, server)
    }

    /// The `Authorization` header's value, with a token.
    fn bearer(&self) -> Option<String> {
        self.config.token.as_ref().map(|t| format!("Bearer {t}"))
    }

    /// A JSON reply; one that does not parse counts against its server, as a failed transfer does. Its
    /// bytes are not counted: a manifest's time is mostly the server's planning, not a delivery rate.
    async fn json<T: serde::de::DeserializeOwned>(&self, path_and_query: &str) -> Result<T, ClientError> {
        let (flight, server, data, _) = self.small_body(path_and_query).await?;
        match serde_json::from_slice(&data) {
            Ok(v) => {
                flight.succeeded(0);
                Ok(v)
            }
            Err(e) => {
                flight.failed();
                Err(ClientError::Malformed { server, message: format!("{path_and_query}: {e}") })
            }
        }
    }

    /// A binary reply, with the server that sent it and the index id its head gave (empty: none).
    async fn bytes(&self, path_and_query: &str) -> Result<(Bytes, String, String), ClientError> {
        let (flight, server, data, index_id) = self.small_body(path_and_query).await?;
        flight.succeeded(data.len() as u64);
        Ok((data, server, index_id.unwrap_or_default()))
    }

    /// A whole small reply (JSON, the sample table), abandoned after `stall_timeout` without a byte, with
    /// its flight for the caller to close, the server that sent it and the index id its head gave.
    async fn small_body(
        &self,
        path_and_query: &str,
    ) -> Result<(InFlight<'_>, String, Bytes, Option<String>), ClientError> {
        for turn in 1.. {
            let (flight, server, got) =
                self.send(0, path_and_query, None, Target::Whole(Whole::default()), REPLY_BYTES, None).await?;
            match got {
                Got::Whole(whole) => return Ok((flight, server, Bytes::from(whole.bytes), whole.index_id)),
                Got::OtherIndex { index_id, .. } => self.other_index(flight, server, index_id, turn)?,
                Got::Body(_) => unreachable!("a reply asked for whole comes whole"),
            }
        }
        unreachable!("the turns end in a reply or an error")
    }

    /// A reply of `server` (on `flight`, the request's `turn`th) named `index_id`, not the mount's index:
    /// `Ok` where another server may serve the mount's, in rotation or once back from a failure or a rest
    /// (the request goes there next, waiting out a rest; at most one turn per server), else
    /// [`ClientError::OtherIndex`] where every server is known to serve another index (no retry mends it),
    /// or [`ClientError::OthersOut`] where the turns ran out first (retried).
    fn other_index(
        &self,
        flight: InFlight<'_>,
        server: String,
        index_id: String,
        turn: usize,
    ) -> Result<(), ClientError> {
        let mounted = self.index_id.get().map_or("", |i| &**i);
        match (flight.other_index(&index_id, mounted), turn < self.config.servers.len()) {
            (true, true) => Ok(()),
            (true, false) => Err(ClientError::OthersOut { server, index_id }),
            (false, _) => Err(ClientError::OtherIndex { server, index_id }),
        }
    }

    fn query(&self, format: BatchFormat) -> String {
        BatchQuery { format, ..self.config.query }.to_query()
    }
}

impl BatchClient for HttpClient {
    fn dataset(&self) -> BoxFut<'_, Result<DatasetInfo, ClientError>> {
        let path = api::dataset_path(&self.config.dataset);
        Box::pin(async move { self.json(&path).await })
    }

    fn manifest(&self, epoch: u64, format: BatchFormat) -> BoxFut<'_, Result<Manifest, ClientError>> {
        let path = format!("{}?{}", api::manifest_path(&self.config.dataset, epoch), self.query(format));
        Box::pin(async move { self.json(&path).await })
    }

    fn files(&self, dir: &str, cursor: u64) -> BoxFut<'_, Result<FileList, ClientError>> {
        let query = api::FilesQuery { dir: dir.to_owned(), cursor, limit: 0 }.to_query();
        let path = format!("{}?{query}", api::files_path(&self.config.dataset));
        Box::pin(async move { self.json(&path).await })
    }

    fn slot_table(&self, first_epoch: u64, epochs: u64) -> BoxFut<'_, Result<SlotTable, ClientError>> {
        let query = RollingQuery { plan: self.config.query.plan, first_epoch, epochs }.to_query();
        let path = format!("{}?{query}", api::rolling_path(&self.config.dataset));
        Box::pin(async move { self.json(&path).await })
    }

    fn fetch_body(&self, request: &Request, attempt: u32, into: Sink, expect: Sent) -> BodyFut<'_> {
        let attempt = attempt as usize;
        let dataset = &self.config.dataset;
        // Which server answers: ties between idle servers rotate by what is asked for (a retry finds the
        // server that failed out of rotation, and rotates on as well).
        let (spread, path, range) = match request {
            Request::Batch { epoch, batch, format } => {
                let path = format!("{}?{}", api::batch_path(dataset, *epoch, *batch), self.query(*format));
                (*batch as usize, path, None)
            }
            Request::Samples(ids) => {
                let path = format!("{}?{}", api::sample_data_path(dataset), api::sample_ids_query(ids));
                (ids.first().map_or(0, |&i| i as usize), path, None)
            }
            Request::File { path, offset } => {
                let spread = path.len().wrapping_add((offset / batchfs::index::CHUNK_BYTES) as usize);
                // An empty file has no range to ask for.
                (spread, api::file_path(dataset, path), (expect.bytes > 0).then_some((*offset, expect.bytes)))
            }
        };
        Box::pin(async move { self.fetch(spread.wrapping_add(attempt), &path, range, into, expect).await })
    }

    fn sample_table(&self) -> BoxFut<'_, Result<SampleTable, ClientError>> {
        let path = api::samples_path(&self.config.dataset);
        Box::pin(async move {
            let (data, server, index_id) = self.bytes(&path).await?;
            let table = SampleTable::decode(&data).ok_or_else(|| ClientError::Malformed {
                server,
                message: format!("{path}: {} bytes are not whole sample records", data.len()),
            })?;
            Ok(SampleTable { index_id, ..table })
        })
    }

    fn received(&self) -> u64 {
        self.received.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The first index given is kept: a mount plans with one, and its client serves no other.
    fn expect_index(&self, index_id: &str) {
        if !index_id.is_empty() {
            let _ = self.index_id.set(index_id.into());
        }
    }
}

/// A response whose status is not a success: its error (what its JSON body said), and what it tells of
/// its server's health. A 4xx is the request's fault, not the server's; a 503 with `Retry-After` is a
/// server shedding load, saturated rather than failing: it rests as long as it asks.
fn refused(flight: InFlight<'_>, server: String, status: u16, retry_after: Option<u64>, body: &[u8]) -> ClientError {
    let message = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(body) => body.error,
        Err(_) => StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("error").to_owned(),
    };
    match retry_after {
        Some(seconds) => flight.shed(Duration::from_secs(seconds)),
        None if status >= 500 => flight.failed(),
        None => {}
    }
    ClientError::Status { server, status, message }
}

impl HttpClient {
    /// A whole response body of at most `expect.bytes` bytes, received into `body`, or of the `(offset,
    /// len)` range of the resource if given (a server that answers a range from a non-zero offset with the
    /// whole resource is refused, not trusted); a response with no bytes for `stall_timeout` is abandoned.
    /// A body whose size or CRC32C is not `expect`'s counts against its server, as a failed transfer does,
    /// and is [`ClientError::Corrupt`]; one whose bytes failed their checksum has its next attempt ask the
    /// server that sent it to recheck them (`client/recheck.rs`).
    async fn fetch(
        &self,
        spread: usize,
        path_and_query: &str,
        range: Option<(u64, u64)>,
        body: Sink,
        expect: Sent,
    ) -> Result<Body, ClientError> {
        let (mut recheck, from) = (self.suspects.take(path_and_query), range.map_or(0, |r| r.0));
        let (mut target, mut turn) = (Target::Sink(body), 0);
        // A server of another index hands the sink back untouched: the next server may fill it.
        let (flight, server, body) = loop {
            turn += 1;
            let sent = self.send(spread, path_and_query, range, target, expect.bytes, recheck.take()).await;
            let (flight, server, got) = match sent {
                Ok(sent) => sent,
                Err(e) => {
                    let of = |s: &String| self.config.servers.iter().position(|u| u == s);
                    if let (Some(span), ClientError::Corrupt { server, .. }) = (failed_span(&e, from), &e) {
                        of(server).into_iter().for_each(|n| self.suspects.failed(path_and_query, n, span));
                    }
                    return Err(e);
                }
            };
            match got {
                Got::Body(body) => break (flight, server, body),
                Got::OtherIndex { index_id, sink: Some(sink) } => {
                    self.other_index(flight, server, index_id, turn)?;
                    target = Target::Sink(sink);
                }
                Got::OtherIndex { sink: None, .. } | Got::Whole(_) => {
                    unreachable!("a body asked for into a sink comes in it, or with it")
                }
            }
        };
        if let Some(why) = expect.mismatch(&body) {
            // All its bytes came, and differ (a short body is no copy's fault).
            if body.sink.len() == expect.bytes {
                self.suspects.failed(path_and_query, flight.server(), (from, from + expect.bytes));
            }
            flight.failed();
            let cause = std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{path_and_query}: {why}"));
            return Err(ClientError::Corrupt { server, cause: Arc::new(cause) });
        }
        self.suspects.passed(path_and_query);
        flight.succeeded(body.sink.len());
        Ok(body)
    }

    /// GETs `path_and_query` (its `range`, if given) into `target`, at most `expect` bytes, from the server
    /// the health view picks, or, with a `recheck` (a server and the ranges to name), from that server
    /// asking it to recheck them, on one of its connections: what it delivered, with its flight for the
    /// caller to close (a failure closes it here) and the server that sent it.
    async fn send(
        &self,
        spread: usize,
        path_and_query: &str,
        range: Option<(u64, u64)>,
        target: Target,
        expect: u64,
        recheck: Option<(usize, String)>,
    ) -> Result<(InFlight<'_>, String, Got), ClientError> {
        // A small reply's size is not known before it comes; it weighs nothing in the routing.
        let about = if matches!(target, Target::Sink(_)) { expect } else { 0 };
        let (flight, lane, server) = self.route(spread, about, recheck.as_ref().map(|r| r.0)).await;
        let wire = match self.wire(lane, &server).await {
            Ok(w) => w,
            Err(e) => {
                flight.failed();
                return Err(e);
            }
        };
        let token = self.bearer();
        let bytes = range.map(|(offset, len)| format!("bytes={offset}-{}", offset + len - 1));
        let mut fields = Vec::new();
        if let Some(token) = &token {
            fields.push(("authorization", token.as_str()));
        }
        if let Some(bytes) = &bytes {
            fields.push(("range", bytes.as_str()));
        }
        if let Some((_, spans)) = &recheck {
            tracing::info!(%server, path = path_and_query, spans, "asking the server to recheck a body that failed");
            fields.push((api::RECHECK_HEADER, spans.as_str()));
        }
        let (range_from, index_id) = (range.map_or(0, |r| r.0), self.index_id.get().cloned());
        let ask = Ask { path_and_query, fields: &fields, expect, range_from, index_id };
        match wire.get(ask, target, self.config.stall_timeout).await {
            Ok(Reply { body: Ok(got), .. }) => Ok((flight, server, got)),
            Ok(Reply { status, retry_after, body: Err(message) }) => {
                Err(refused(flight, server, status, retry_after, &message))
            }
            // Never taken by the server (its connection closing): asked again, no failure of its.
            Err(e) if super::wire::not_sent(&e) => Err(e),
            Err(e) => {
                flight.failed();
                Err(e)
            }
        }
    }

    /// Connection `lane` (to `server`), made if it has none or the last one ended.
    async fn wire(&self, lane: usize, server: &str) -> Result<Arc<Wire>, ClientError> {
        let mut held = self.wires[lane].lock().await;
        if let Some(wire) = held.as_ref().filter(|w| w.usable()) {
            return Ok(wire.clone());
        }
        let uri: http::Uri = server
            .parse()
            .map_err(|e| ClientError::Malformed { server: server.to_owned(), message: format!("not a URL: {e}") })?;
        let stream = self.connector.open(&uri).await.map_err(|e| ClientError::unreachable(server, e))?;
        let inbox = if matches!(stream, Stream::Plain(_)) { INBOX } else { 0 };
        let keep = (!self.config.keepalive.is_zero())
            .then_some(KeepAlive { every: self.config.keepalive, wait: self.config.stall_timeout });
        let wire = Wire::start(stream, server, (self.config.frame_size, inbox), keep, self.received.clone());
        *held = Some(wire.clone());
        Ok(wire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffers::Filling;

    const BATCH_0: Request = Request::Batch { epoch: 0, batch: 0, format: BatchFormat::Tfrecord };

    #[test]
    fn urls() {
        assert_eq!(parse_url("http://storage:7878/imagenet"), Ok(("http://storage:7878".into(), "imagenet".into())));
        assert_eq!(parse_url("https://h/a%20b/"), Ok(("https://h".into(), "a b".into())));
        assert_eq!(parse_url("http://h/a%3Fb%23c"), Ok(("http://h".into(), "a?b#c".into())));
        for bad in ["storage:7878/x", "ftp://h/x", "http://h", "http://h/", "http:///x", "http://h/a/b"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        for (bad, credentials) in [
            ("http://u:p@h/x", true),
            ("https://token@h:1/x", true),
            ("http://h/x?y=1", false),
            ("http://h/x#y", false),
        ] {
            let e = parse_url(bad).unwrap_err();
            assert_eq!(matches!(e, UrlError::Credentials(_)), credentials, "{bad}: {e}");
            assert_eq!(matches!(e, UrlError::Query(_)), !credentials, "{bad}: {e}");
        }
    }

    /// An h2c server that answers every request with `body`, announcing `content_length` if given.
    async fn h2c_server(body: Vec<u8>, content_length: Option<usize>) -> String {
        h2c_server_counting(body, content_length).await.0
    }

    /// [`h2c_server`], with the count of connections it has accepted.
    async fn h2c_server_counting(body: Vec<u8>, content_length: Option<usize>) -> (String, Arc<AtomicUsize>) {
        let (url, accepted, _) = scripted_server(move |_, _| {
            let mut response = http::Response::builder().status(200);
            if let Some(len) = content_length {
                response = response.header("content-length", len);
            }
            (response, body.clone())
        })
        .await;
        (url, accepted)
    }

    /// An h2c server answering each request (its headers, and its number from 1) with the head and body
    /// `answer` gives: its URL, and the counts of the connections it accepted and of the requests it got.
    async fn scripted_server(
        answer: impl Fn(&http::HeaderMap, usize) -> (http::response::Builder, Vec<u8>) + Send + Sync + 'static,
    ) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, asked) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (counted, numbered, answer) = (accepted.clone(), asked.clone(), Arc::new(answer));
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let (numbered, answer) = (numbered.clone(), answer.clone());
                tokio::spawn(async move {
                    let mut conn = h2::server::handshake(socket).await.unwrap();
                    while let Some(Ok((request, mut respond))) = conn.accept().await {
                        let n = numbered.fetch_add(1, Ordering::SeqCst) + 1;
                        let (response, data) = answer(request.headers(), n);
                        let mut stream = respond.send_response(response.body(()).unwrap(), false).unwrap();
                        let _ = stream.send_data(bytes::Bytes::from(data), true);
                    }
                });
            }
        });
        (format!("http://{addr}"), accepted, asked)
    }

    fn client_of(server: String) -> HttpClient {
        client_of_all(vec![server])
    }

    fn client_of_all(servers: Vec<String>) -> HttpClient {
        HttpClient::new(HttpConfig {
            servers,
            dataset: "d".into(),
            query: BatchQuery::default(),
            token: None,
            connections: 1,
            ca_file: None,
            stall_timeout: Duration::from_secs(5),
            keepalive: Duration::from_secs(15),
            connect_timeout: Duration::from_secs(5),
            frame_size: 128 << 10,
        })
        .unwrap()
    }

    #[tokio::test]
    async fn a_body_longer_than_the_manifest_says_is_cut_off() {
        let body: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let crc = crc32c::crc32c(&body);
        let fetch = |server: String, expect: u64| async move {
            let sink = Sink::Buffer(Filling::new(Vec::new(), (expect, 0), None, || {}));
            client_of(server).fetch_body(&BATCH_0, 0, sink, Sent { bytes: expect, crc32c: crc }).await
        };
        // The announced length is checked before any byte is read.
        let err = fetch(h2c_server(body.clone(), Some(3000)).await, 1000).await.unwrap_err();
        assert!(
            matches!(&err, ClientError::Malformed { message, .. } if message.contains("announced 3000 bytes")),
            "{err}"
        );
        // Without a length, reading stops at the expected size.
        let err = fetch(h2c_server(body.clone(), None).await, 1000).await.unwrap_err();
        assert!(matches!(&err, ClientError::Malformed { message, .. } if message.contains("ran past 1000")), "{err}");
        // The expected size is read whole with its CRC.
        let got = fetch(h2c_server(body.clone(), None).await, 3000).await.unwrap();
        let Sink::Buffer(filled) = got.sink else { panic!("a buffer") };
        assert_eq!((filled.finish(), got.crc32c), (bytes::Bytes::from(body.clone()), crc));
        // A body shorter than announced, or with other bytes, is corrupt, and counts against its server.
        for (expect, crc) in [(5000, crc), (3000, crc ^ 1)] {
            let client = client_of(h2c_server(body.clone(), None).await);
            let sink = Sink::Buffer(Filling::new(Vec::new(), (expect, 0), None, || {}));
            let err = client.fetch_body(&BATCH_0, 0, sink, Sent { bytes: expect, crc32c: crc }).await.unwrap_err();
            assert!(matches!(&err, ClientError::Corrupt { .. }), "{err}");
            let s = &client.health().snapshot()[0];
            assert_eq!((s.failures, s.taken_out), (1, 1), "{s:?}");
        }
    }

    /// A JSON reply that does not parse is an error naming the server and the request, and counts against
    /// that server's health as a failed transfer does; a reply that parses does not.
    #[tokio::test]
    async fn a_reply_that_is_not_json_names_its_server_and_counts_as_a_failure() {
        let server = h2c_server(b"<html>a proxy's page</html>".to_vec(), None).await;
        let client = client_of(server.clone());
        let err = client.dataset().await.unwrap_err();
        assert!(
            matches!(&err, ClientError::Malformed { server: s, message } if *s == server && message.contains("/d")),
            "{err}"
        );
        assert_eq!(client.health().snapshot()[0].failures, 1);
        let info = serde_json::to_vec(&serde_json::json!({"error": "x"})).unwrap();
        let client = client_of(h2c_server(info, None).await);
        let body: ErrorBody = client.json("/v1/anything").await.unwrap();
        assert_eq!((body.error.as_str(), client.health().snapshot()[0].failures), ("x", 0));
    }

    /// The JSON replies and the bodies share a server's connections: a client of one connection a server
    /// makes one, whatever it asks, and a reply with no announced length is gathered whole.
    #[tokio::test]
    async fn json_replies_and_bodies_share_the_connections() {
        let reply = serde_json::to_vec(&serde_json::json!({"error": "x".repeat(300_000)})).unwrap();
        let (server, accepted) = h2c_server_counting(reply.clone(), None).await;
        let client = client_of(server);
        for _ in 0..3 {
            let got: ErrorBody = client.json("/v1/anything").await.unwrap();
            assert_eq!(got.error.len(), 300_000);
            let sink = Sink::Buffer(Filling::new(Vec::new(), (reply.len() as u64, 0), None, || {}));
            let expect = Sent { bytes: reply.len() as u64, crc32c: crc32c::crc32c(&reply) };
            let body = client.fetch_body(&BATCH_0, 0, sink, expect).await.unwrap();
            assert_eq!(body.crc32c, crc32c::crc32c(&reply));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// An h2c server that answers every request with `body`, its head naming index `index_id` (none: as a
    /// server of a release before index ids), with the count of requests it got.
    async fn indexed_server(body: Vec<u8>, index_id: Option<&'static str>) -> (String, Arc<AtomicUsize>) {
        let (url, _, asked) = scripted_server(move |_, _| {
            let mut response = http::Response::builder().status(200);
            if let Some(id) = index_id {
                response = response.header(api::INDEX_ID_HEADER, id);
            }
            (response, body.clone())
        })
        .await;
        (url, asked)
    }

    /// An h2c server that answers every request with `body`, its byte 10 flipped in the first `bad` answers,
    /// recording the `x-batchfs-recheck` each request carried.
    async fn rotting_server(body: Vec<u8>, bad: usize) -> (String, Arc<std::sync::Mutex<Vec<Option<String>>>>) {
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = asked.clone();
        let (url, _, _) = scripted_server(move |headers, n| {
            let recheck = headers.get(api::RECHECK_HEADER).map(|v| v.to_str().unwrap().to_owned());
            seen.lock().unwrap().push(recheck);
            let mut data = body.clone();
            if n <= bad {
                data[10] ^= 1;
            }
            (http::Response::builder().status(200), data)
        })
        .await;
        (url, asked)
    }

    /// A reply whose head names another index than the one expected is refused at its head, none of its
    /// bytes taken, and the request goes at once to another server, which serves it; that server is then
    /// passed over. Where no other server may serve the expected index, the request fails at once naming
    /// the server and its index; a server that names no index (a release before them) is taken as it is.
    #[tokio::test]
    async fn a_server_of_another_index_is_refused_at_the_head_and_passed_over() {
        let (good, other) = (vec![1u8; 3000], vec![2u8; 3000]);
        async fn fetch(client: &HttpClient, batch: u64) -> Result<Bytes, ClientError> {
            let good = vec![1u8; 3000];
            let expect = Sent { bytes: 3000, crc32c: crc32c::crc32c(&good) };
            let sink = Sink::Buffer(Filling::new(Vec::new(), (3000, 0), None, || {}));
            let request = Request::Batch { epoch: 0, batch, format: BatchFormat::Tfrecord };
            let body = client.fetch_body(&request, 0, sink, expect).await?;
            let Sink::Buffer(filled) = body.sink else { panic!("a buffer") };
            Ok(filled.finish())
        }
        let (a, asked_a) = indexed_server(other.clone(), Some("0000000000000002")).await;
        let (b, asked_b) = indexed_server(good.clone(), Some("0000000000000001")).await;
        let client = client_of_all(vec![a.clone(), b.clone()]);
        client.expect_index("0000000000000001");
        // Batch 0 goes to server a first (idle servers share the batches by number).
        for batch in 0..4 {
            assert_eq!(fetch(&client, batch).await.unwrap(), good, "batch {batch}");
        }
        assert_eq!(asked_a.load(Ordering::SeqCst), 1, "passed over once found serving another index");
        assert_eq!(asked_b.load(Ordering::SeqCst), 4);
        let s = client.health().snapshot();
        assert!(s[0].other_index && s[0].failures == 0 && !s[1].other_index, "{s:?}");
        // Alone: the request fails at once, for good.
        let started = std::time::Instant::now();
        let lone = client_of(a.clone());
        lone.expect_index("0000000000000001");
        let err = fetch(&lone, 1).await.unwrap_err();
        let named = |server: &str, index_id: &str| server == a && index_id == "0000000000000002";
        assert!(matches!(&err, ClientError::OtherIndex { server, index_id } if named(server, index_id)), "{err}");
        assert!(!err.is_retryable());
        assert!(started.elapsed() < Duration::from_secs(3), "at once: {:?}", started.elapsed());
        // Beside a server that is down (not known to serve another index): that one is tried, and the
        // request fails as it does, to be retried until it is back.
        let down = "http://127.0.0.1:1".to_owned();
        let beside = client_of_all(vec![down.clone(), a.clone()]);
        beside.health().begin(0, 0).failed();
        beside.expect_index("0000000000000001");
        let err = fetch(&beside, 1).await.unwrap_err();
        assert!(matches!(&err, ClientError::Unreachable { server, .. } if *server == down), "{err}");
        assert!(err.is_retryable());
        // Where the turns run out before a server that may serve the mount's index is tried: retried.
        let flight = beside.health.begin_on(1, 0);
        let err = beside.other_index(flight, a.clone(), "0000000000000002".into(), 2).unwrap_err();
        assert!(matches!(&err, ClientError::OthersOut { server, .. } if *server == a) && err.is_retryable(), "{err}");
        let (old, _) = indexed_server(good.clone(), None).await;
        let client = client_of(old);
        client.expect_index("0000000000000001");
        assert_eq!(fetch(&client, 0).await.unwrap(), good, "a server before index ids: nothing compared");
    }

    /// An h2c server whose first `fail` answers have `status` (with `Retry-After: 1` where `retry_after`),
    /// the rest `body`, every head naming index `index_id`.
    async fn flaky_server(
        fail: usize,
        status: u16,
        retry_after: bool,
        body: Vec<u8>,
        index_id: &'static str,
    ) -> String {
        let (url, _, _) = scripted_server(move |_, n| {
            let response = http::Response::builder().header(api::INDEX_ID_HEADER, index_id);
            match n <= fail {
                true if retry_after => {
                    (response.status(status).header("retry-after", "1"), b"{\"error\": \"transient\"}".to_vec())
                }
                true => (response.status(status), b"{\"error\": \"transient\"}".to_vec()),
                false => (response.status(200), body.clone()),
            }
        })
        .await;
        url
    }

    /// A replica of another index (server a) beside the server of the mount's (b), which fails once (a
    /// 500: out of rotation for 1 s) or sheds once (a 503 with `Retry-After: 1`): the next request is
    /// refused at a's head and goes to b (at once where b failed, after its rest where it shed), which
    /// serves it; it never fails for the other index while b may serve the mount's.
    #[tokio::test]
    async fn a_blip_of_the_server_of_the_mounts_index_beside_a_replica_of_another_is_waited_out() {
        let (good, other) = (vec![1u8; 3000], vec![2u8; 3000]);
        async fn fetch(client: &HttpClient) -> Result<Bytes, ClientError> {
            let sink = Sink::Buffer(Filling::new(Vec::new(), (3000, 0), None, || {}));
            let request = Request::Batch { epoch: 0, batch: 1, format: BatchFormat::Tfrecord };
            let expect = Sent { bytes: 3000, crc32c: crc32c::crc32c(&[1u8; 3000]) };
            let Sink::Buffer(filled) = client.fetch_body(&request, 0, sink, expect).await?.sink else {
                panic!("a buffer")
            };
            Ok(filled.finish())
        }
        for (status, retry_after) in [(500, false), (503, true)] {
            let (a, asked_a) = indexed_server(other.clone(), Some("0000000000000002")).await;
            let b = flaky_server(1, status, retry_after, good.clone(), "0000000000000001").await;
            let client = client_of_all(vec![a, b]);
            client.expect_index("0000000000000001");
            // Batch 1 goes to server b first (idle servers share the batches by number).
            let first = fetch(&client).await.unwrap_err();
            assert!(matches!(&first, ClientError::Status { status: s, .. } if *s == status), "{first}");
            let started = std::time::Instant::now();
            let second = fetch(&client).await;
            assert_eq!(second.map_err(|e| e.to_string()), Ok(good.clone().into()), "after a {status}");
            assert_eq!(asked_a.load(Ordering::SeqCst), 1, "after a {status}: a refused at its head once");
            if retry_after {
                assert!(started.elapsed() >= Duration::from_millis(900), "b's rest was waited out");
            }
        }
    }

    /// A head whose index id is empty says no index, as one without the field: nothing is compared.
    #[tokio::test]
    async fn an_empty_index_id_is_no_index_id() {
        let body = vec![1u8; 3000];
        let (server, asked) = indexed_server(body.clone(), Some("")).await;
        let client = client_of(server);
        client.expect_index("0000000000000001");
        let sink = Sink::Buffer(Filling::new(Vec::new(), (3000, 0), None, || {}));
        let got = client.fetch_body(&BATCH_0, 0, sink, Sent { bytes: 3000, crc32c: crc32c::crc32c(&body) }).await;
        let Sink::Buffer(filled) = got.unwrap().sink else { panic!("a buffer") };
        assert_eq!((filled.finish(), asked.load(Ordering::SeqCst)), (Bytes::from(body), 1));
    }

    /// A body that fails its checksum has its next attempt sent to the server that sent it, out of rotation
    /// though that server now is and with a replica beside it, naming the body's bytes that failed; the
    /// attempt after a good body names nothing.
    #[tokio::test]
    async fn a_corrupt_body_is_asked_again_of_its_server_naming_the_bytes_to_recheck() {
        let body: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let expect = Sent { bytes: 3000, crc32c: crc32c::crc32c(&body) };
        let (bad, bad_asked) = rotting_server(body.clone(), 1).await;
        let (good, good_asked) = rotting_server(body.clone(), 0).await;
        let client =
            HttpClient::new(HttpConfig { servers: vec![bad, good], ..client_of(String::new()).config }).unwrap();
        let fetch = |attempt| {
            let sink = Sink::Buffer(Filling::new(Vec::new(), (3000, 0), None, || {}));
            client.fetch_body(&BATCH_0, attempt, sink, expect)
        };
        // Batch 0's first attempt goes to the first server (ties rotate by the batch number).
        assert!(matches!(fetch(0).await.unwrap_err(), ClientError::Corrupt { .. }));
        assert!(!client.health().snapshot()[0].up, "the server that sent it is out of rotation");
        assert_eq!(fetch(1).await.unwrap().crc32c, expect.crc32c);
        assert_eq!(*bad_asked.lock().unwrap(), [None, Some("0-2999".to_owned())]);
        assert!(good_asked.lock().unwrap().is_empty(), "the replica was not asked");
        fetch(2).await.unwrap();
        let asked: Vec<Option<String>> =
            [bad_asked, good_asked].iter().flat_map(|a| a.lock().unwrap().clone()).collect();
        assert_eq!(asked.iter().filter(|a| a.is_some()).count(), 1, "a good body asks nothing after: {asked:?}");
    }

    /// An h2c server whose first `shed` answers are `503` with `Retry-After: 1` (a server shedding load),
    /// the rest `body`; it records when each request came.
    async fn shedding_server(shed: usize, body: Vec<u8>) -> (String, Arc<std::sync::Mutex<Vec<std::time::Instant>>>) {
        let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = arrivals.clone();
        let (url, _, _) = scripted_server(move |_, n| {
            seen.lock().unwrap().push(std::time::Instant::now());
            match n <= shed {
                true => {
                    let response = http::Response::builder().status(503).header("retry-after", "1");
                    (response, b"{\"error\": \"saturated\"}".to_vec())
                }
                false => (http::Response::builder().status(200), body.clone()),
            }
        })
        .await;
        (url, arrivals)
    }

    /// A server shedding load (`503` with `Retry-After`) is not failing: it is not taken out of rotation
    /// for a doubling backoff, and its `Retry-After` is honoured (a request to it, when it is the only
    /// one, waits that long).
    #[tokio::test]
    async fn shedding_is_not_failing_and_retry_after_is_honoured() {
        let body = vec![7u8; 1000];
        let (server, arrivals) = shedding_server(1, body.clone()).await;
        let client = client_of(server);
        let fetch = || {
            let sink = Sink::Buffer(Filling::new(Vec::new(), (1000, 0), None, || {}));
            client.fetch_body(&BATCH_0, 0, sink, Sent { bytes: 1000, crc32c: crc32c::crc32c(&body) })
        };
        let err = fetch().await.unwrap_err();
        assert!(err.is_retryable(), "{err}");
        let s = &client.health().snapshot()[0];
        assert_eq!((s.failures, s.taken_out, s.sheds), (0, 0, 1), "{s:?}");
        let got = fetch().await.unwrap();
        assert_eq!(got.sink.len(), 1000);
        let arrivals = arrivals.lock().unwrap().clone();
        let waited = arrivals[1] - arrivals[0];
        assert!(waited >= Duration::from_millis(900), "the retry came {waited:?} after the 503 with Retry-After: 1");
    }
}
