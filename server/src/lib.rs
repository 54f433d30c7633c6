//! batchfs-server: indexes datasets once and serves pre-batched batch files over HTTP/2 (h2c with prior
//! knowledge or TLS with ALPN `h2`; HTTP/1.1 too), with the limits of [`ServerLimits`].
//!
//! [`start`] binds and serves a [`Catalog`] until [`RunningServer::shutdown`] (or SIGTERM in the binary):
//! accepting stops, every connection is asked to finish (HTTP/2 GOAWAY), in-flight batches complete,
//! and connections still busy after the drain timeout are closed.

#![deny(clippy::undocumented_unsafe_blocks)]

mod activity;
pub mod aligned;
pub mod body;
pub mod catalog;
pub mod cli;
pub mod config;
pub mod demo;
mod framing;
pub mod memo;
pub mod metrics;
pub mod objects;
pub mod policy;
pub mod progress;
pub mod sendfile;
pub mod service;
pub mod storage;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod tls;

use crate::catalog::Catalog;
use crate::config::ServerLimits;
use crate::service::AppState;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

pub use tls::TlsFiles;

/// Everything needed to serve besides the datasets.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub tls: Option<TlsFiles>,
    pub token: Option<Vec<u8>>,
    pub limits: ServerLimits,
}

/// A server accepting connections.
pub struct RunningServer {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    state: Arc<AppState>,
}

impl RunningServer {
    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &metrics::Metrics {
        &self.state.metrics
    }

    /// A counter of body bytes sent, for energy attribution.
    pub fn bytes_sent(&self) -> batchfs_energy::ByteCounter {
        let metrics = self.state.metrics.clone();
        Arc::new(move || metrics.response_bytes.load(Ordering::Relaxed))
    }

    /// Stops accepting, lets in-flight requests finish (up to the drain timeout), and returns.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }

    /// Waits until the server stops (after a shutdown signal).
    pub async fn wait(self) {
        let _ = self.task.await;
    }

    /// A handle that triggers shutdown.
    pub fn shutdown_handle(&self) -> watch::Sender<bool> {
        self.shutdown.clone()
    }
}

/// Binds `options.listen` and serves `catalog`.
///
/// The catalog may still be filling: datasets announced in it ([`Catalog::announce`]) are answered with
/// 503 until inserted, and `/healthz` says which are ready.
pub async fn start(catalog: impl Into<Arc<Catalog>>, options: ServeOptions) -> anyhow::Result<RunningServer> {
    let limits = options.limits.clone();
    // A shard truncated under a mapping must not kill the server (see `storage.rs`).
    if let Err(e) = batchfs::mmap::guard_truncation() {
        tracing::warn!(error = %e, "cannot guard mapped shards: a shard truncated while served stops the server");
    }
    let state = Arc::new(AppState::new(catalog.into(), options.token.clone(), &limits));
    let tls = match &options.tls {
        Some(files) => Some(tls::acceptor(files)?),
        None => None,
    };
    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", options.listen))?;
    let addr = listener.local_addr()?;
    let (shutdown, rx) = watch::channel(false);
    let task = tokio::spawn(accept_loop(listener, tls, state.clone(), limits, rx));
    tracing::info!(%addr, tls = options.tls.is_some(), "serving");
    Ok(RunningServer { addr, shutdown, task, state })
}

fn builder(limits: &ServerLimits) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192) as usize);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_header_list_size(limits.max_header_bytes)
        .max_pending_accept_reset_streams(limits.max_pending_accept_reset_streams)
        .max_local_error_reset_streams(limits.max_local_error_reset_streams)
        .initial_stream_window_size(limits.stream_window)
        .initial_connection_window_size(limits.connection_window)
        .max_frame_size(limits.max_frame_size)
        .max_send_buf_size(limits.max_send_buf_size)
        .keep_alive_interval(limits.keep_alive_interval)
        .keep_alive_timeout(limits.keep_alive_timeout);
    b
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<AppState>,
    limits: ServerLimits,
    mut shutdown: watch::Receiver<bool>,
) {
    let builder = Arc::new(builder(&limits));
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let mut tasks = JoinSet::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.changed() => break,
            p = connections.clone().acquire_owned() => p.expect("never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        if limits.unsent_bytes > 0 {
            // What the socket holds unsent goes out in the order written; the rest waits in HTTP/2's
            // per-stream queues, which take streams in turn. Unbounded, a narrow link's socket held
            // megabytes of one stream's frames before another's first (docs/CONFIGURATION.md).
            let _ = socket2::SockRef::from(&stream).set_tcp_notsent_lowat(limits.unsent_bytes);
        }
        while tasks.try_join_next().is_some() {}
        let (state, builder, tls, limits, shutdown) =
            (state.clone(), builder.clone(), tls.clone(), limits.clone(), shutdown.clone());
        tasks.spawn(async move {
            state.metrics.connections_total.fetch_add(1, Ordering::Relaxed);
            state.metrics.connections_open.fetch_add(1, Ordering::Relaxed);
            match tls {
                Some(acceptor) => {
                    match tokio::time::timeout(limits.header_read_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(io)) => serve_connection(io, state.clone(), &builder, &limits, shutdown).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
                None if limits.sendfile => {
                    let stream = sendfile::FileSendStream::new(stream, state.metrics.clone());
                    serve_connection(stream, state.clone(), &builder, &limits, shutdown).await
                }
                None => serve_connection(stream, state.clone(), &builder, &limits, shutdown).await,
            }
            state.metrics.connections_open.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    tracing::info!(connections = tasks.len(), "shutting down: draining connections");
    let drained =
        tokio::time::timeout(limits.drain_timeout, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(connections = tasks.len(), "drain timeout reached; closing remaining connections");
        tasks.shutdown().await;
    }
}

async fn serve_connection<I>(
    io: I,
    state: Arc<AppState>,
    builder: &auto::Builder<TokioExecutor>,
    limits: &ServerLimits,
    mut shutdown: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = activity::Activity::new();
    let io = activity::ActivityIo::new(io, activity.clone());
    let touched = activity.clone();
    let service = hyper::service::service_fn(move |req| {
        touched.touch();
        service::handle(state.clone(), req)
    });
    let mut conn = pin!(builder.serve_connection(TokioIo::new(io), service));
    // Closing: asked to (the server stops; its drain_timeout bounds the wait), or for idleness.
    let (mut closing, mut idle_closing) = (false, false);
    let period = limits.idle_timeout.max(Duration::from_millis(100)) / 4;
    // A stream may wait on the server, not its client, this long (a response head, a read of the store):
    // a connection asked to close is dropped only past it.
    let grace = period.max(limits.request_timeout).max(limits.object_retry_for);
    let mut tick = tokio::time::interval(period);
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = shutdown.changed(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tick.tick() => {
                let idle = activity.idle();
                if !closing && idle >= limits.idle_timeout {
                    tracing::debug!(?idle, "closing idle connection");
                    (closing, idle_closing) = (true, true);
                    conn.as_mut().graceful_shutdown();
                } else if idle_closing && idle >= limits.idle_timeout.saturating_add(grace) {
                    // Its streams still open, none moving since, longer than any waits on the server:
                    // bodies a client no longer reads (HTTP/2's window shut), which a graceful close would
                    // wait for without end, each holding its place in max_bodies_in_flight.
                    tracing::info!(?idle, "closing a connection whose bodies its client stopped reading");
                    return;
                }
            }
        }
    }
}
