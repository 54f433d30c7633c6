//! Request handling: routing, authentication, the JSON endpoints and the streamed batch and file
//! bodies. One `tracing` span per request; errors are logged once, here, where they become a response.
//!
//! The file reads top down: the state, `Failure` (an error with its HTTP status, each error type mapped
//! once) and how it becomes a response; [`handle`] (span, timeout, metrics, HEAD); `dispatch`, which
//! checks the method, answers `/healthz`, checks the token and admits bodies of bytes and large JSON
//! documents (503 past `max_bodies_in_flight`), then calls one function per route (`metrics`, `datasets`,
//! `dataset_info`, `manifest`, `batch`, `rolling`, `samples`, `sample_data`, `files`, `file`); last, what those share:
//! `layout_response` (a body's headers), `ranged` (conditional and range requests) and `warm_ahead`.
//! Planning, shard checks and tables run on the blocking pool through `blocking`, never on a worker.

use crate::body::{Body, SegmentBody, StreamContext};
use crate::catalog::{Catalog, Dataset, Readiness, ServedFile};
use crate::config::ServerLimits;
use crate::framing::{Framing, Held, Refused};
use crate::metrics::{Kind, Metrics};
use batchfs::api::{self, ApiError, BatchQuery, DatasetList, ErrorBody, RangeRequest, RollingQuery, Route};
use batchfs::encode::{self, BatchLayout, Segment};
use batchfs::plan::PlanError;
use batchfs::rolling::RollingError;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use lru::LruCache;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use tracing::Instrument;

mod warm;
use warm::warm_ahead;

/// Everything a request handler needs.
pub struct AppState {
    pub catalog: Arc<Catalog>,
    /// Bearer token required on every request but `/healthz`.
    pub token: Option<Vec<u8>>,
    pub metrics: Arc<Metrics>,
    pub stream: Arc<StreamContext>,
    /// Batches warmed ahead of each batch request.
    pub readahead_batches: u64,
    /// Time allowed to produce a response head.
    pub request_timeout: Duration,
    /// Bodies in flight past which batch and file requests are answered 503 at once.
    pub max_bodies_in_flight: u64,
    /// The memory the layouts of bodies in flight may hold (`framing_memory`).
    framing: Arc<Framing>,
    warmed: Mutex<LruCache<(String, u64, BatchQuery, u64), ()>>,
}

impl AppState {
    /// The state of a server with these `limits` (the streaming, warming and admission ones).
    pub fn new(catalog: Arc<Catalog>, token: Option<Vec<u8>>, limits: &ServerLimits) -> Self {
        let metrics = Arc::new(Metrics::default());
        let stream =
            StreamContext::new(limits.storage_concurrency, limits.chunk_size, limits.read_depth, metrics.clone());
        AppState {
            catalog,
            token,
            stream: Arc::new(stream),
            framing: Framing::new(limits.framing_memory, metrics.clone()),
            metrics,
            readahead_batches: limits.readahead_batches,
            request_timeout: limits.request_timeout,
            max_bodies_in_flight: limits.max_bodies_in_flight,
            warmed: Mutex::new(LruCache::new(NonZeroUsize::new(4096).expect("nonzero"))),
        }
    }
}

/// A response that is an error.
struct Failure {
    status: StatusCode,
    message: String,
    /// Seconds to send as `Retry-After` (503 for a dataset still being indexed).
    retry_after: Option<u32>,
    /// The id of the index of the dataset the request named, sent in [`api::INDEX_ID_HEADER`] (a 404 of
    /// a file another index does not have says so).
    index_id: Option<HeaderValue>,
}

impl From<Refused> for Failure {
    fn from(refused: Refused) -> Self {
        match refused {
            Refused::TooLarge { .. } => Failure::new(StatusCode::BAD_REQUEST, refused.to_string()),
            Refused::Busy { .. } => {
                Failure { retry_after: Some(1), ..Failure::new(StatusCode::SERVICE_UNAVAILABLE, refused.to_string()) }
            }
        }
    }
}

impl Failure {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Failure { status, message: message.into(), retry_after: None, index_id: None }
    }
}

/// What `Retry-After` says while a dataset is being indexed.
const INDEXING_RETRY_AFTER_S: u32 = 5;

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        match e {
            ApiError::BadRequest(m) => Failure::new(StatusCode::BAD_REQUEST, m),
            e @ ApiError::NotFound(_) => Failure::new(StatusCode::NOT_FOUND, e.to_string()),
        }
    }
}

impl From<PlanError> for Failure {
    fn from(e: PlanError) -> Self {
        let status = match e {
            PlanError::NoSuchBatch { .. } => StatusCode::NOT_FOUND,
            _ => StatusCode::BAD_REQUEST,
        };
        Failure::new(status, e.to_string())
    }
}

impl From<crate::storage::ShardChanged> for Failure {
    fn from(e: crate::storage::ShardChanged) -> Self {
        Failure::new(StatusCode::CONFLICT, e.to_string())
    }
}

impl From<RollingError> for Failure {
    fn from(e: RollingError) -> Self {
        match e {
            RollingError::Plan(e) => e.into(),
            e => Failure::new(StatusCode::BAD_REQUEST, e.to_string()),
        }
    }
}

fn json_response<T: serde::Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    body_response(status, serde_json::to_vec_pretty(value).expect("API types serialize"))
}

fn body_response(status: StatusCode, body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Body::full(body))
        .expect("valid response")
}

/// A 200 of a large JSON document already serialized (a memoized manifest or slot table, whose buffer
/// every response shares; a page of a listing), counted among the bodies in flight until it is sent.
fn held_response(state: &AppState, json: bytes::Bytes) -> Response<Body> {
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, json.len())
        .body(Body::held(json, &state.stream))
        .expect("valid response")
}

fn failure_response(f: &Failure) -> Response<Body> {
    let mut response = json_response(f.status, &ErrorBody { error: f.message.clone() });
    if f.status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"batchfs\""));
    }
    if let Some(s) = f.retry_after {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    if let Some(id) = &f.index_id {
        response.headers_mut().insert(api::INDEX_ID_HEADER, id.clone());
    }
    response
}

/// The index id of dataset `name` as a header's value, where it is ready and has one.
fn index_id_of(state: &AppState, name: &str) -> Option<HeaderValue> {
    index_id_header(&*state.catalog.get(name)?)
}

/// The index id of `ds` as a header's value, where it has one.
fn index_id_header(ds: &Dataset) -> Option<HeaderValue> {
    Some(ds.index_id()).filter(|id| !id.is_empty()).and_then(|id| HeaderValue::from_str(id).ok())
}

/// Every reply about a dataset that got past the token check and admission (`dispatch`; those before,
/// docs/API.md lists them, say none), a success or an error, says in [`api::INDEX_ID_HEADER`] the index it
/// was served from, so a mount compares it with its own as the head arrives: a body of another index is
/// refused before any byte of it is taken. Bodies of bytes have it from the very dataset that served them
/// (`layout_response`); the rest here, from the dataset the catalog holds now.
fn with_index_id(
    state: &AppState,
    name: Option<&str>,
    result: Result<Response<Body>, Failure>,
) -> Result<Response<Body>, Failure> {
    let Some(name) = name else { return result };
    match result {
        Ok(mut r) if !r.headers().contains_key(api::INDEX_ID_HEADER) => {
            if let Some(id) = index_id_of(state, name) {
                r.headers_mut().insert(api::INDEX_ID_HEADER, id);
            }
            Ok(r)
        }
        Ok(r) => Ok(r),
        Err(f) => Err(Failure { index_id: index_id_of(state, name), ..f }),
    }
}

fn kind_of(route: &Result<Route, ApiError>) -> Kind {
    match route {
        Ok(Route::Batch { .. }) | Ok(Route::SampleData { .. }) => Kind::Batch,
        Ok(Route::Manifest { .. }) => Kind::Manifest,
        Ok(Route::File { .. }) | Ok(Route::Files { .. }) => Kind::File,
        _ => Kind::Other,
    }
}

/// Handles one request.
pub async fn handle<B>(state: Arc<AppState>, req: Request<B>) -> Result<Response<Body>, std::convert::Infallible> {
    let start = Instant::now();
    let route = Route::parse(req.uri().path());
    let kind = kind_of(&route);
    let (method, path, query) = (req.method(), req.uri().path(), req.uri().query().unwrap_or(""));
    let span = tracing::info_span!("request", %method, %path, query);
    let response = async {
        let result =
            tokio::time::timeout(state.request_timeout, dispatch(&state, &req, route)).await.unwrap_or_else(|_| {
                Err(Failure::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("request timed out after {:?}; retry", state.request_timeout),
                ))
            });
        match result {
            Ok(response) => response,
            Err(f) => {
                if f.status.is_server_error() {
                    tracing::error!(status = f.status.as_u16(), error = %f.message, "request failed");
                } else {
                    tracing::debug!(status = f.status.as_u16(), error = %f.message, "request refused");
                }
                failure_response(&f)
            }
        }
    }
    .instrument(span)
    .await;
    state.metrics.record(kind, response.status().as_u16(), start.elapsed());
    let mut response = response;
    if let Some(b) = response.body().in_memory() {
        state.metrics.response_bytes.fetch_add(b.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }
    if req.method() == Method::HEAD {
        *response.body_mut() = Body::empty();
    }
    Ok(response)
}

/// The credentials of an `Authorization` value of the Bearer scheme, whose name is case-insensitive (RFC
/// 9110, 11.1): `bearer T` and `BEARER T` as `Bearer T`.
fn bearer(value: &str) -> Option<&str> {
    let (scheme, credentials) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(credentials)
}

fn check_token(state: &AppState, req: &Request<impl Sized>) -> Result<(), Failure> {
    let Some(expected) = &state.token else {
        return Ok(());
    };
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer).map(str::trim);
    match given {
        None => Err(Failure::new(
            StatusCode::UNAUTHORIZED,
            "this server requires a token: send `Authorization: Bearer TOKEN`",
        )),
        Some(t) if bool::from(t.as_bytes().ct_eq(expected)) => Ok(()),
        Some(_) => {
            Err(Failure::new(StatusCode::UNAUTHORIZED, "the bearer token is wrong; check the client's token file"))
        }
    }
}

fn dataset(state: &AppState, name: &str) -> Result<Arc<Dataset>, Failure> {
    match state.catalog.readiness(name) {
        Readiness::Ready(ds) => Ok(ds),
        Readiness::Indexing { done, total } => Err(Failure {
            retry_after: Some(INDEXING_RETRY_AFTER_S),
            ..Failure::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("dataset {name:?} is still being indexed ({}); retry shortly", percent(done, total)),
            )
        }),
        Readiness::Unknown => {
            let known = state.catalog.names();
            Err(Failure::new(StatusCode::NOT_FOUND, format!("unknown dataset {name:?}; this server has {known:?}")))
        }
    }
}

/// Admits a body of bytes (a batch, samples' data, a file) or a large JSON document (a manifest, a slot
/// table, a page of a listing) unless as many bodies are in flight as
/// `max_bodies_in_flight` allows: then a 503 at once, with `Retry-After`.
fn admit(state: &AppState) -> Result<(), Failure> {
    let in_flight = state.metrics.in_flight.load(std::sync::atomic::Ordering::Relaxed);
    if in_flight < state.max_bodies_in_flight {
        return Ok(());
    }
    Err(Failure {
        retry_after: Some(1),
        ..Failure::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the server is saturated ({in_flight} bodies in flight, max_bodies_in_flight); retry shortly or \
                 use another replica"
            ),
        )
    })
}

fn percent(done: u64, total: u64) -> String {
    if total == 0 {
        "starting".to_owned()
    } else {
        format!("{:.0} %", done as f64 * 100.0 / total as f64)
    }
}

/// `/healthz`: 200 `ok` once every dataset is ready; until then 503 with `Retry-After` and a line per
/// dataset saying whether it is ready or how far its indexing is (the server answers while it indexes).
fn health(state: &AppState) -> Response<Body> {
    let pending = state.catalog.pending();
    if pending.is_empty() {
        // Up; a dataset whose shards changed under the server is named, with what is refused.
        let mut text = String::from("ok\n");
        for ds in state.catalog.datasets() {
            for c in ds.storage.changed() {
                text.push_str(&format!("{} changed: {c}\n", c.dataset));
            }
            if let Some(note) = ds.tier_note() {
                text.push_str(&format!("{} disk tier: {note}\n", ds.name));
            }
        }
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/plain")
            .header(header::CONTENT_LENGTH, text.len())
            .body(Body::full(text))
            .expect("valid");
    }
    let mut text = String::from("indexing\n");
    for ds in state.catalog.datasets() {
        text.push_str(&format!("{} ready\n", ds.name));
    }
    for (name, done, total) in pending {
        text.push_str(&format!("{name} indexing {}\n", percent(done, total)));
    }
    Response::builder()
        .status(StatusCode::SERVICE_UNAVAILABLE)
        .header(header::CONTENT_TYPE, "text/plain")
        .header(header::RETRY_AFTER, INDEXING_RETRY_AFTER_S)
        .header(header::CONTENT_LENGTH, text.len())
        .body(Body::full(text))
        .expect("valid")
}

/// Answers a request: the method, `/healthz`, the token and, for a body of bytes, admission are checked
/// here, in that order, then one function per route answers it.
async fn dispatch<B>(
    state: &Arc<AppState>,
    req: &Request<B>,
    route: Result<Route, ApiError>,
) -> Result<Response<Body>, Failure> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r =
            failure_response(&Failure::new(StatusCode::METHOD_NOT_ALLOWED, "batchfs is read-only: use GET or HEAD"));
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(r);
    }
    let route = route?;
    if route == Route::Health {
        return Ok(health(state));
    }
    check_token(state, req)?;
    // Bodies of bytes, and listing pages (each its own, one entry per file). Manifests and slot tables are
    // counted in flight too, and refused only where not cached (their handlers): a cached one is one
    // buffer however many ask, and a mount that could not have the next epoch's manifest (computed ahead
    // when the last was asked for) while batches kept the server saturated failed its lookups.
    let admitted = matches!(route, Route::Batch { .. } | Route::File { .. } | Route::SampleData { .. })
        || matches!(route, Route::Files { .. });
    if admitted {
        admit(state)?;
    }
    let query = req.uri().query().unwrap_or("");
    let name = match &route {
        Route::Dataset { name } | Route::Manifest { name, .. } | Route::Batch { name, .. } => Some(name.clone()),
        Route::Rolling { name } | Route::Samples { name } | Route::SampleData { name } => Some(name.clone()),
        Route::Files { name } | Route::File { name, .. } => Some(name.clone()),
        Route::Health | Route::Metrics | Route::Datasets => None,
    };
    let result = match route {
        Route::Health => unreachable!("handled above"),
        Route::Metrics => Ok(metrics(state)),
        Route::Datasets => Ok(datasets(state)),
        Route::Dataset { name } => dataset_info(state, &name),
        Route::Manifest { name, epoch } => manifest(state, &name, epoch, query).await,
        Route::Batch { name, epoch, batch: number } => batch(state, req, &name, epoch, number).await,
        Route::Rolling { name } => rolling(state, &name, query).await,
        Route::Samples { name } => samples(state, &name).await,
        Route::SampleData { name } => sample_data(state, req, &name).await,
        Route::Files { name } => files(state, &name, query).await,
        Route::File { name, path } => file(state, req, &name, &path).await,
    };
    with_index_id(state, name.as_deref(), result)
}

/// Runs `f` on the blocking pool (planning, shard checks and tables take milliseconds to seconds: never
/// on a tokio worker); a task that panicked or was cancelled is a 500.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Failure> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// `/metrics`: the server's counters, each dataset's and the disk tier's, in Prometheus' text format.
fn metrics(state: &AppState) -> Response<Body> {
    let datasets = state.catalog.datasets();
    let each = datasets.iter().map(|d| {
        let objects = d.storage.objects().map(|o| &o.counters);
        (d.name.as_str(), d.manifests_computed(), d.storage.changed().len(), objects)
    });
    let tier = datasets.iter().find_map(|d| d.storage.objects().and_then(|o| o.tier()).cloned());
    let text =
        state.metrics.render() + &crate::metrics::render_datasets(each) + &crate::metrics::render_tier(tier.as_deref());
    Response::builder()
        .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
        .header(header::CONTENT_LENGTH, text.len())
        .body(Body::full(text))
        .expect("valid")
}

/// `/datasets`: every dataset ready.
fn datasets(state: &AppState) -> Response<Body> {
    let datasets = state.catalog.datasets().iter().map(|d| d.info()).collect();
    json_response(StatusCode::OK, &DatasetList { datasets })
}

/// `/datasets/NAME`.
fn dataset_info(state: &AppState, name: &str) -> Result<Response<Body>, Failure> {
    Ok(json_response(StatusCode::OK, &dataset(state, name)?.info()))
}

/// An epoch's manifest; the next epoch's is computed in the background.
async fn manifest(state: &AppState, name: &str, epoch: u64, query: &str) -> Result<Response<Body>, Failure> {
    // The query first: a bad one is a 400 even while the dataset is indexed (a 503 had its client retry it).
    let query = BatchQuery::parse(query)?;
    let ds = dataset(state, name)?;
    if !ds.has_manifest(epoch, &query) {
        admit(state)?;
    }
    let manifest = blocking({
        let ds = ds.clone();
        move || ds.manifest(epoch, &query)
    })
    .await??;
    // A job that asks for epoch e reads e + 1 next: its manifest (seconds at a million samples) is computed
    // now, in the background, so that request (and a first `ls` of that epoch) finds it ready.
    if let Some(next) = epoch.checked_add(1).filter(|&e| !ds.has_manifest(e, &query)) {
        tokio::task::spawn_blocking(move || ds.manifest(next, &query));
    }
    Ok(held_response(state, manifest))
}

/// A batch's body, with its sample count; the next batches of the plan are warmed.
async fn batch<B>(
    state: &Arc<AppState>,
    req: &Request<B>,
    name: &str,
    epoch: u64,
    batch: u64,
) -> Result<Response<Body>, Failure> {
    let query = BatchQuery::parse(req.uri().query().unwrap_or(""))?;
    let ds = dataset(state, name)?;
    tracing::debug!(dataset = %ds.name, epoch, batch, format = query.format.as_str(), "batch asked for");
    let (ds2, framing, asked) = (ds.clone(), state.framing.clone(), recheck_asked(req)?);
    let (layout, held, samples) = blocking(move || {
        let what = format!("batch {batch} of epoch {epoch} of dataset {:?}", ds2.name);
        let built = framing.build(&what, |charge| Ok::<_, Failure>(ds2.layout(epoch, batch, &query, charge)?));
        let (layout, held, samples) = built?;
        ds2.check(&layout.segments)?;
        rechecked(&ds2, asked.as_deref(), &layout)?;
        Ok::<_, Failure>((layout, held, samples))
    })
    .await??;
    warm_ahead(state, &ds, epoch, batch, query);
    let mut r = layout_response(state, req, &ds, (layout, Some(held)), query.format.content_type())?;
    if describes_body(r.status()) {
        r.headers_mut().insert(api::SAMPLES_HEADER, HeaderValue::from(samples));
    }
    Ok(r)
}

/// A rolling plan's slot table (one number per record of an epoch: compact JSON).
async fn rolling(state: &AppState, name: &str, query: &str) -> Result<Response<Body>, Failure> {
    let query = RollingQuery::parse(query)?;
    let ds = dataset(state, name)?;
    if !ds.has_slot_table(&query) {
        admit(state)?;
    }
    let table = blocking(move || ds.slot_table(&query)).await??;
    Ok(held_response(state, table))
}

/// The sample table, with its CRC32C and the id of the index it was made of (a header: the table stays
/// 16 bytes a sample, and a client before it reads it as it did).
async fn samples(state: &AppState, name: &str) -> Result<Response<Body>, Failure> {
    let ds = dataset(state, name)?;
    let index_id = ds.index_id().to_owned();
    let table = blocking(move || ds.sample_table()).await?;
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(api::CRC32C_HEADER, format!("{:08x}", batchfs::crc::crc32c(&table)))
        .header(api::INDEX_ID_HEADER, index_id)
        .header(header::CONTENT_LENGTH, table.len())
        .body(Body::full(table))
        .expect("valid"))
}

/// The data of the samples the query names, in its order.
async fn sample_data<B>(state: &AppState, req: &Request<B>, name: &str) -> Result<Response<Body>, Failure> {
    // The query's form first, as the other routes' (a 400 while the dataset is indexed), then its ids'
    // bounds.
    api::parse_sample_ids(req.uri().query().unwrap_or(""), u64::MAX)?;
    let ds = dataset(state, name)?;
    let ids = api::parse_sample_ids(req.uri().query().unwrap_or(""), ds.index.samples.len() as u64)?;
    let (ds2, asked) = (ds.clone(), recheck_asked(req)?);
    let layout = blocking(move || {
        let layout = ds2.data_layout(&ids);
        ds2.check(&layout.segments)?;
        rechecked(&ds2, asked.as_deref(), &layout)?;
        Ok::<_, Failure>(layout)
    })
    .await??;
    layout_response(state, req, &ds, (layout, None), "application/octet-stream")
}

/// A page of a dataset's directory listing (up to 100,000 entries: listed and serialized on the blocking
/// pool, and held in flight until sent).
async fn files(state: &AppState, name: &str, query: &str) -> Result<Response<Body>, Failure> {
    let q = api::FilesQuery::parse(query)?;
    let ds = dataset(state, name)?;
    let json = blocking(move || {
        let page = ds.list(&q).ok_or_else(|| {
            Failure::new(StatusCode::NOT_FOUND, format!("dataset {:?} has no directory {:?}", ds.name, q.dir))
        })?;
        Ok::<_, Failure>(serde_json::to_vec_pretty(&page).expect("API types serialize"))
    })
    .await??;
    Ok(held_response(state, json.into()))
}

/// A file of a dataset: a shard, or a file made beside them.
async fn file<B>(state: &AppState, req: &Request<B>, name: &str, path: &str) -> Result<Response<Body>, Failure> {
    let ds = dataset(state, name)?;
    let file = ds
        .file(path)
        .ok_or_else(|| Failure::new(StatusCode::NOT_FOUND, format!("dataset {name:?} has no file {path:?}")))?;
    let info = ds.file_info(file);
    let segments = match file {
        ServedFile::Stored(n) => vec![Segment::Data { shard: *n, offset: 0, len: info.size }],
        ServedFile::Made(made) => vec![Segment::Inline(made.bytes.clone())],
    };
    let layout = BatchLayout { segments, len: info.size, crc32c: info.crc32c, checkpoints: Vec::new() };
    let (ds2, layout, asked) = (ds.clone(), layout, recheck_asked(req)?);
    let layout = blocking(move || {
        ds2.check(&layout.segments)?;
        rechecked(&ds2, asked.as_deref(), &layout)?;
        Ok::<_, Failure>(layout)
    })
    .await??;
    layout_response(state, req, &ds, (layout, None), "application/octet-stream")
}

/// The ranges of its body that a request asks the server to recheck (`x-batchfs-recheck`: its client
/// found them failing their checksum), as given; a value that is not text is a 400.
fn recheck_asked<B>(req: &Request<B>) -> Result<Option<String>, Failure> {
    let Some(value) = req.headers().get(api::RECHECK_HEADER) else { return Ok(None) };
    let text = value.to_str().map_err(|_| {
        Failure::new(StatusCode::BAD_REQUEST, format!("{}: not text; give ranges A-B of the body", api::RECHECK_HEADER))
    })?;
    Ok(Some(text.to_owned()))
}

/// Rechecks the disk tier's copies under the ranges `asked` names of the body laid out as `layout`
/// (`objects/recheck.rs`), before the body is served: a copy whose bytes differ is dropped, and the body
/// reads the store. A range outside the body is a 400. Blocks: call on the blocking pool.
fn rechecked(ds: &Dataset, asked: Option<&str>, layout: &BatchLayout) -> Result<(), Failure> {
    let Some(asked) = asked else { return Ok(()) };
    let spans = api::parse_recheck(asked, layout.len)
        .map_err(|e| Failure::new(StatusCode::BAD_REQUEST, format!("dataset {:?}: {e}", ds.name)))?;
    if let Some(objects) = ds.storage.objects().filter(|o| o.tier().is_some()) {
        objects.recheck(&ds.name, &layout.segments, &spans);
    }
    Ok(())
}

/// Whether a response of `ranged` is of the body (200, 206, 304), and so carries what describes it: its
/// type, CRC32C and sample count. A 416's body is a JSON error, and says so.
fn describes_body(status: StatusCode) -> bool {
    matches!(status, StatusCode::OK | StatusCode::PARTIAL_CONTENT | StatusCode::NOT_MODIFIED)
}

/// The response for a body of bytes laid out as `layout` (a batch, samples' data, a file), with what it
/// holds of the layouts' budget: `ranged`'s, with, if it is of the body, its type, its CRC32C and, on a
/// 200, its checkpoints (they describe the whole body: a range's client cannot use them).
fn layout_response<B>(
    state: &AppState,
    req: &Request<B>,
    ds: &Dataset,
    (layout, held): (BatchLayout, Option<Held>),
    content_type: &'static str,
) -> Result<Response<Body>, Failure> {
    let etag = api::etag(layout.crc32c, layout.len);
    let mut r = ranged(state, req, ds, (layout.segments, held), layout.len, &etag)?;
    if !describes_body(r.status()) {
        return Ok(r);
    }
    let ok = r.status() == StatusCode::OK;
    let headers = r.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The index the bytes come from: a mount of another refuses them at this head.
    if let Some(id) = index_id_header(ds) {
        headers.insert(api::INDEX_ID_HEADER, id);
    }
    headers.insert(api::CRC32C_HEADER, HeaderValue::from_str(&format!("{:08x}", layout.crc32c)).expect("hex"));
    if ok && !layout.checkpoints.is_empty() {
        let value = api::format_checkpoints(&layout.checkpoints);
        headers.insert(api::CHECKPOINTS_HEADER, HeaderValue::from_str(&value).expect("hex"));
    }
    Ok(r)
}

/// A 200, 206, 304, 412 or 416 response for a body of `len` bytes made of `segments` (which hold `held` of
/// the layouts' budget until the body is dropped).
fn ranged<B>(
    state: &AppState,
    req: &Request<B>,
    ds: &Dataset,
    (segments, held): (Vec<Segment>, Option<Held>),
    len: u64,
    etag: &str,
) -> Result<Response<Body>, Failure> {
    let header_str = |name| req.headers().get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    let mut builder = Response::builder()
        .header(header::ETAG, etag)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CACHE_CONTROL, "public, max-age=31536000, immutable");
    // If-Match (RFC 9110, 13.1.1), first: `*` or the ETag compared strongly (a weak `W/"x"` never matches);
    // anything else, or a value that is not text, is a 412.
    if let Some(v) = req.headers().get(header::IF_MATCH) {
        if !v.to_str().is_ok_and(|v| v.split(',').any(|t| t.trim() == "*" || t.trim() == etag)) {
            let message = format!("If-Match {v:?} does not match the body's ETag {etag}");
            return Err(Failure::new(StatusCode::PRECONDITION_FAILED, message));
        }
    }
    // Compared weakly, as RFC 9110 says for If-None-Match: `W/"x"` is `"x"`.
    let weak = |t: &str| t.trim().trim_start_matches("W/").to_owned();
    if header_str(header::IF_NONE_MATCH).is_some_and(|v| v.split(',').any(|t| weak(t) == weak(etag) || t.trim() == "*"))
    {
        return Ok(builder.status(StatusCode::NOT_MODIFIED).body(Body::empty()).expect("valid"));
    }
    // If-Range with another validator means "send everything".
    let range = match header_str(header::IF_RANGE) {
        Some(v) if v.trim() != etag => RangeRequest::Full,
        _ => api::parse_range(header_str(header::RANGE), len),
    };
    let (status, segments, body_len) = match range {
        RangeRequest::Full => (StatusCode::OK, segments, len),
        RangeRequest::Partial { start, end } => {
            builder = builder.header(header::CONTENT_RANGE, format!("bytes {start}-{}/{len}", end - 1));
            (StatusCode::PARTIAL_CONTENT, encode::slice_segments(&segments, start, end), end - start)
        }
        RangeRequest::Unsatisfiable => {
            let r = failure_response(&Failure::new(
                StatusCode::RANGE_NOT_SATISFIABLE,
                format!("range outside the body's {len} bytes"),
            ));
            let (mut parts, body) = r.into_parts();
            parts
                .headers
                .insert(header::CONTENT_RANGE, HeaderValue::from_str(&format!("bytes */{len}")).expect("ascii"));
            return Ok(Response::from_parts(parts, body));
        }
    };
    let body = SegmentBody::new(state.stream.clone(), ds.storage.clone(), segments).holding(held);
    Ok(builder.status(status).header(header::CONTENT_LENGTH, body_len).body(Body::Segments(body)).expect("valid"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfs::gen::{self, GenOptions};
    use batchfs::source::{IndexOptions, NoProgress};

    /// A server's state of a generated TFRecord dataset `d` (its data in the directory returned), admitting
    /// `max_bodies_in_flight` bodies, and a runtime to drive its requests.
    fn state(max_bodies_in_flight: u64) -> (tempfile::TempDir, Arc<AppState>, tokio::runtime::Runtime) {
        state_within(ServerLimits { max_bodies_in_flight, chunk_size: 4096, ..ServerLimits::default() })
    }

    /// [`state`] with these `limits`.
    fn state_within(limits: ServerLimits) -> (tempfile::TempDir, Arc<AppState>, tokio::runtime::Runtime) {
        let data = tempfile::tempdir().unwrap();
        let options =
            GenOptions { samples: 300, mean_bytes: 512, shards: 3, classes: 4, seed: 2, ..Default::default() };
        gen::generate(&options, data.path()).unwrap();
        let io = limits.io_policy();
        let ds = Dataset::open("d", data.path(), None, &IndexOptions::default(), &NoProgress, io).unwrap();
        let catalog = Catalog::default();
        catalog.insert(ds).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        (data, Arc::new(AppState::new(Arc::new(catalog), None, &limits)), runtime)
    }

    /// The response to a request of `method` for `uri` with `headers`.
    fn request(
        (state, rt): (&Arc<AppState>, &tokio::runtime::Runtime),
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
    ) -> Response<Body> {
        let mut req = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        rt.block_on(handle(state.clone(), req.body(()).unwrap())).unwrap()
    }

    /// The bytes a response holds in memory (none for a streamed body).
    fn held(r: &Response<Body>) -> Option<bytes::Bytes> {
        r.body().in_memory().cloned()
    }

    /// Which replies say the dataset's index id (docs/API.md): those about a dataset it holds ready that
    /// passed the token check and admission, successes and errors; not a 405, a 401, admission's 503, a
    /// reply about a dataset it does not hold, nor `/healthz`.
    #[test]
    fn replies_past_the_token_and_admission_say_the_index_id_and_the_ones_before_do_not() {
        let (_data, state, rt) = state(1);
        let id = state.catalog.datasets()[0].index_id().to_owned();
        let said = |r: &Response<Body>| r.headers().get(api::INDEX_ID_HEADER).map(|v| v.to_str().unwrap().to_owned());
        let get = |uri: &str| request((&state, &rt), Method::GET, uri, &[]);
        let held = get("/v1/datasets/d/epochs/0/batches/0?batch_size=4");
        let refused = get("/v1/datasets/d/epochs/0/batches/1?batch_size=4");
        assert_eq!((held.status(), refused.status()), (StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!((said(&held), said(&refused)), (Some(id.clone()), None), "admission's 503 says none");
        drop(held);
        for (uri, status) in [("/v1/datasets/d", 200), ("/v1/datasets/d/epochs/0?batch_size=0", 400)] {
            let r = get(uri);
            assert_eq!((r.status().as_u16(), said(&r)), (status, Some(id.clone())), "{uri}");
        }
        for (uri, status) in [("/v1/datasets/nope", 404), ("/healthz", 200)] {
            let r = get(uri);
            assert_eq!((r.status().as_u16(), said(&r)), (status, None), "{uri}");
        }
        let post = request((&state, &rt), Method::POST, "/v1/datasets/d", &[]);
        assert_eq!((post.status(), said(&post)), (StatusCode::METHOD_NOT_ALLOWED, None));
        let limits = ServerLimits::default();
        let guarded = Arc::new(AppState::new(state.catalog.clone(), Some(b"t".to_vec()), &limits));
        let unauthorized = request((&guarded, &rt), Method::GET, "/v1/datasets/d", &[]);
        assert_eq!((unauthorized.status(), said(&unauthorized)), (StatusCode::UNAUTHORIZED, None));
    }

    /// Unread manifests, slot tables and listing pages keep their places among `max_bodies_in_flight`
    /// until sent or dropped; past it a listing page (each its own) and a manifest or slot table not
    /// cached are refused (503) rather than making the server hold one more; a cached one (one shared
    /// buffer) is still answered, the next epoch's manifest among them (computed ahead).
    #[test]
    fn unread_json_documents_count_among_the_bodies_in_flight() {
        let (_data, state, rt) = state(2);
        let get = |uri: &str| request((&state, &rt), Method::GET, uri, &[]);
        let manifest = get("/v1/datasets/d/epochs/0?batch_size=1");
        let page = get("/v1/datasets/d/files?limit=100000");
        assert_eq!((manifest.status(), page.status()), (StatusCode::OK, StatusCode::OK));
        // Past it: a listing page, and a manifest or slot table not cached, refused; a cached one (one
        // buffer however many ask; the next epoch's manifest, computed ahead) answered.
        for uri in ["/v1/datasets/d/files", "/v1/datasets/d/epochs/5?batch_size=1", "/v1/datasets/d/rolling?epochs=2"] {
            let refused = get(uri);
            assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE, "{uri}");
            assert_eq!(refused.headers()[header::RETRY_AFTER], "1");
        }
        let ds = state.catalog.datasets()[0].clone();
        let next = BatchQuery::parse("batch_size=1").unwrap();
        for _ in 0..500 {
            if ds.has_manifest(1, &next) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let answered = get("/v1/datasets/d/epochs/1?batch_size=1");
        assert_eq!(answered.status(), StatusCode::OK, "the next epoch's, computed ahead");
        assert_eq!(state.metrics.in_flight.load(std::sync::atomic::Ordering::Relaxed), 3);
        drop(answered);
        // A document is handed on `chunk_size` at a time and keeps its place until its last byte is.
        let len = held(&manifest).unwrap().len();
        let mut body = manifest.into_body();
        let (mut sent, mut frames) = (0, 0);
        while let Some(frame) = rt.block_on(http_body_util::BodyExt::frame(&mut body)) {
            sent += bytes::Buf::remaining(&frame.unwrap().into_data().ok().unwrap());
            frames += 1;
            assert_eq!(state.metrics.in_flight.load(std::sync::atomic::Ordering::Relaxed), 2);
        }
        assert_eq!((sent, frames), (len, len.div_ceil(4096)));
        drop((body, page));
        assert_eq!(state.metrics.in_flight.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(get("/v1/datasets/d/rolling?epochs=2").status(), StatusCode::OK);
        // HEAD sends no body: nothing stays in flight.
        assert_eq!(request((&state, &rt), Method::HEAD, "/v1/datasets/d/files", &[]).status(), StatusCode::OK);
        assert_eq!(state.metrics.in_flight.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    /// A recheck names ranges of the body asked for: one past its end, or not ranges, is a 400 that says
    /// why (batches, samples' data and files alike); one within it is served as the body is (a local dataset
    /// has no copies to recheck).
    #[test]
    fn a_recheck_outside_the_body_is_a_bad_request() {
        let (_data, state, rt) = state(1024);
        let file =
            ["/v1/datasets/d/files/", &state.catalog.datasets()[0].list(&Default::default()).unwrap().files[0].path]
                .concat();
        let uris = ["/v1/datasets/d/epochs/0/batches/0?batch_size=2", "/v1/datasets/d/samples/data?ids=1,2", &file];
        for uri in uris {
            for bad in ["0-99999999", "5-1", "bytes=0-1", "x"] {
                let r = request((&state, &rt), Method::GET, uri, &[(api::RECHECK_HEADER, bad)]);
                assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{uri} {bad}");
                let said = serde_json::from_slice::<ErrorBody>(&held(&r).unwrap()).unwrap().error;
                assert!(said.contains(api::RECHECK_HEADER) && said.contains("dataset \"d\""), "{said}");
            }
            let r = request((&state, &rt), Method::GET, uri, &[(api::RECHECK_HEADER, "0-9,20-29")]);
            assert_eq!(r.status(), StatusCode::OK, "{uri}");
        }
    }

    /// A 416's body is a JSON error: it says so, and carries nothing that describes the body asked for
    /// (it had the batch's `Content-Type`, CRC32C and sample count); a 206 still carries them.
    #[test]
    fn an_unsatisfiable_range_is_a_json_error_without_the_bodys_headers() {
        let (_data, state, rt) = state(1024);
        let uris = ["/v1/datasets/d/epochs/0/batches/0?batch_size=2", "/v1/datasets/d/samples/data?ids=1,2"];
        let file =
            ["/v1/datasets/d/files/", &state.catalog.datasets()[0].list(&Default::default()).unwrap().files[0].path]
                .concat();
        for uri in uris.iter().copied().chain([file.as_str()]) {
            let r = request((&state, &rt), Method::GET, uri, &[("range", "bytes=99999999-")]);
            assert_eq!(r.status(), StatusCode::RANGE_NOT_SATISFIABLE, "{uri}");
            assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json", "{uri}");
            assert!(r.headers()[header::CONTENT_RANGE].to_str().unwrap().starts_with("bytes */"), "{uri}");
            for name in [api::CRC32C_HEADER, api::SAMPLES_HEADER, api::CHECKPOINTS_HEADER] {
                assert!(!r.headers().contains_key(name), "{uri}: {name}");
            }
            let r = request((&state, &rt), Method::GET, uri, &[("range", "bytes=1-2")]);
            assert_eq!(r.status(), StatusCode::PARTIAL_CONTENT, "{uri}");
            assert_ne!(r.headers()[header::CONTENT_TYPE], "application/json", "{uri}");
            assert!(r.headers().contains_key(api::CRC32C_HEADER), "{uri}");
        }
        let r = request((&state, &rt), Method::GET, uris[0], &[("range", "bytes=1-2")]);
        assert_eq!(r.headers()[api::SAMPLES_HEADER], "2");
    }

    /// A batch of many small samples held its layout (1 KB a tar member) before a byte was sent, bounded by
    /// nothing (a batch of 2^20 tar samples took 2 GB of the server, four at once 5 GB): the layouts of the
    /// bodies in flight hold at most `framing_memory` together; a layout larger than all of it is refused
    /// for good (400), one meeting the others' charges is retried (503), and a body gives its share back
    /// when dropped.
    #[test]
    fn the_layouts_of_bodies_in_flight_stay_within_framing_memory() {
        // A body may hold a quarter: 1 KiB.
        let (_data, state, rt) = state_within(ServerLimits { framing_memory: 4096, ..ServerLimits::default() });
        let get = |uri: &str| request((&state, &rt), Method::GET, uri, &[]);
        let gauge = || state.metrics.framing_bytes.load(std::sync::atomic::Ordering::Relaxed);
        let whole = get("/v1/datasets/d/epochs/0/batches/0?batch_size=300&format=tar");
        assert_eq!(whole.status(), StatusCode::BAD_REQUEST);
        let error: serde_json::Value = serde_json::from_slice(&held(&whole).unwrap()).unwrap();
        let text = error["error"].as_str().unwrap();
        assert!(
            text.starts_with("batch 0 of epoch 0 of dataset \"d\": its layout") && text.contains("batch_size"),
            "{text}"
        );
        assert_eq!(gauge(), 0, "a refused layout gives back what it took");
        // Batches of 20 samples, each holding its layout while its body is held, until the budget is.
        let mut bodies = Vec::new();
        loop {
            let r = get(&format!("/v1/datasets/d/epochs/0/batches/{}?batch_size=20", bodies.len()));
            if r.status() == StatusCode::SERVICE_UNAVAILABLE {
                assert_eq!(r.headers()[header::RETRY_AFTER], "1");
                break;
            }
            assert_eq!(r.status(), StatusCode::OK);
            bodies.push(r);
            assert!(bodies.len() < 15, "the budget held them all");
        }
        assert!(bodies.len() >= 2 && gauge() > 3 * 1024 && gauge() <= 4096, "{} bodies, {}", bodies.len(), gauge());
        // Still too large for a body while the budget is held: said so, not retried (a TFRecord batch's
        // layout, charged as it grew, was refused at what was left, and answered 503 for ever).
        for format in ["tar", "tfrecord"] {
            let whole = get(&format!("/v1/datasets/d/epochs/0/batches/0?batch_size=300&format={format}"));
            assert_eq!(whole.status(), StatusCode::BAD_REQUEST, "{format}");
        }
        drop(bodies);
        assert_eq!(gauge(), 0);
        assert_eq!(get("/v1/datasets/d/epochs/0/batches/4?batch_size=20").status(), StatusCode::OK);
        assert!(state.metrics.render().contains("batchfs_framing_bytes 0"));
    }

    /// A bad query to a dataset still being indexed was a 503 (its client retried it until the dataset was
    /// ready, then got the 400): the query is looked at first.
    #[test]
    fn a_bad_query_is_refused_while_the_dataset_is_indexed() {
        let (_data, state, rt) = state(1024);
        state.catalog.announce("later").unwrap();
        let get = |uri: &str| request((&state, &rt), Method::GET, uri, &[]).status();
        for uri in [
            "/v1/datasets/later/epochs/0?batch_size=0",
            "/v1/datasets/later/epochs/0/batches/0?format=zip",
            "/v1/datasets/later/rolling?epochs=x",
            "/v1/datasets/later/files?limit=x",
            "/v1/datasets/later/samples/data?ids=1,x",
        ] {
            assert_eq!(get(uri), StatusCode::BAD_REQUEST, "{uri}");
        }
        assert_eq!(get("/v1/datasets/later/epochs/0?batch_size=4"), StatusCode::SERVICE_UNAVAILABLE);
    }

    /// `If-Match` was ignored (`If-Match: "other"` was a 200): a 412 unless `*` or the ETag, strongly.
    #[test]
    fn if_match_is_a_precondition() {
        let (_data, state, rt) = state(1024);
        let uri = "/v1/datasets/d/epochs/0/batches/0?batch_size=2";
        let etag = request((&state, &rt), Method::GET, uri, &[]).headers()[header::ETAG].to_str().unwrap().to_owned();
        let weak = format!("W/{etag}");
        let listed = format!("\"other\", {etag}");
        for (value, status) in [
            ("\"other\"", StatusCode::PRECONDITION_FAILED),
            (weak.as_str(), StatusCode::PRECONDITION_FAILED),
            ("*", StatusCode::OK),
            (etag.as_str(), StatusCode::OK),
            (listed.as_str(), StatusCode::OK),
        ] {
            let r = request((&state, &rt), Method::GET, uri, &[("if-match", value)]);
            assert_eq!(r.status(), status, "If-Match: {value}");
            if status == StatusCode::PRECONDITION_FAILED {
                assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
                assert!(!r.headers().contains_key(api::CRC32C_HEADER));
            }
        }
        let r = request((&state, &rt), Method::GET, uri, &[("if-match", "\"other\""), ("range", "bytes=0-1")]);
        assert_eq!(r.status(), StatusCode::PRECONDITION_FAILED, "before Range");
    }

    /// HEAD says the Content-Length GET does (it had none on these: hyper counts a body, and HEAD's is empty).
    #[test]
    fn head_and_get_say_the_same_content_length() {
        let (_data, state, rt) = state(1024);
        for uri in ["/healthz", "/metrics", "/v1/datasets/d/samples", "/v1/datasets/d", "/v1/datasets/d/files"] {
            let get = request((&state, &rt), Method::GET, uri, &[]);
            let head = request((&state, &rt), Method::HEAD, uri, &[]);
            assert_eq!((get.status(), head.status()), (StatusCode::OK, StatusCode::OK), "{uri}");
            let len = |r: &Response<Body>| r.headers().get(header::CONTENT_LENGTH).cloned();
            assert_eq!(len(&get).map(|l| l.to_str().unwrap().parse().unwrap()), held(&get).map(|b| b.len()), "{uri}");
            assert!(len(&head).is_some(), "{uri}");
            if uri != "/metrics" {
                assert_eq!(len(&head), len(&get), "{uri}");
            }
        }
    }

    /// Every request of a manifest or a slot table sends the memo's buffer: a client opening many of them
    /// and reading none made the server hold a copy of the document each (2.45 GB for 400 of 6 MB).
    #[test]
    fn requests_of_a_manifest_or_slot_table_share_one_buffer() {
        let (_data, state, rt) = state(1024);
        for uri in ["/v1/datasets/d/epochs/0?batch_size=1", "/v1/datasets/d/rolling?batch_size=4&epochs=2"] {
            let (a, b) = (request((&state, &rt), Method::GET, uri, &[]), request((&state, &rt), Method::GET, uri, &[]));
            assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK), "{uri}");
            let (a, b) = (held(&a).unwrap(), held(&b).unwrap());
            assert_eq!(a.as_ptr(), b.as_ptr(), "{uri}: one buffer");
            assert_eq!(a.len(), b.len());
            assert!(a.len() > 1000 && a.starts_with(b"{"), "{uri}");
        }
        // Byte for byte what the API's types serialize to: compact (a pretty manifest cached took 4 times
        // the memory).
        let ds = state.catalog.datasets()[0].clone();
        let manifest: api::Manifest = serde_json::from_slice(&ds.manifest(0, &BatchQuery::default()).unwrap()).unwrap();
        let again = ds.manifest(0, &BatchQuery::default()).unwrap();
        assert_eq!(&serde_json::to_vec(&manifest).unwrap()[..], &again[..]);
    }
    /// The scheme's name in any case (RFC 9110): `bearer T` was refused as no token.
    #[test]
    fn the_bearer_scheme_is_named_in_any_case() {
        for header in ["Bearer t0k", "bearer t0k", "BEARER t0k", "  Bearer t0k"] {
            assert_eq!(super::bearer(header), Some("t0k"), "{header:?}");
        }
        for header in ["Basic dXNlcg==", "Bearert0k", "t0k", ""] {
            assert_eq!(super::bearer(header), None, "{header:?}");
        }
    }
}
