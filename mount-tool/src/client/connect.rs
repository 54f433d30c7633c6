//! The connections under the HTTP/2 client: TCP, and for `https://` servers TLS (rustls's handshake,
//! ALPN `h2`, the web's roots plus `ca_file`; the records then sealed and opened by [`TlsStream`], a
//! body's straight into the memory it goes to).

use super::tls::{self, TlsStream};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Makes the connections of one client: `tls` for `https://` URLs.
#[derive(Clone)]
pub struct Connector {
    tls: Arc<rustls::ClientConfig>,
    timeout: Duration,
}

impl Connector {
    /// `ca_pem`: extra CA certificates (PEM) trusted beside the web's roots, for `https://` servers.
    pub fn new(ca_pem: Option<&[u8]>, timeout: Duration) -> anyhow::Result<Self> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(pem) = ca_pem {
            let certs = rustls_pemfile::certs(&mut &pem[..]).collect::<Result<Vec<_>, _>>()?;
            anyhow::ensure!(!certs.is_empty(), "no certificate in it");
            for cert in certs {
                roots.add(cert)?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        // The records after the handshake are ours to seal and open (`TlsStream`).
        config.enable_secret_extraction = true;
        Ok(Connector { tls: Arc::new(config), timeout })
    }

    /// A connection to `uri`'s server: TCP, or TLS that agreed on `h2`, not yet speaking HTTP/2.
    pub async fn open(&self, uri: &http::Uri) -> io::Result<Stream> {
        let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{uri}: {what}"));
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(invalid("the scheme must be http or https")),
        };
        let host = uri.host().ok_or_else(|| invalid("no host"))?;
        // An IPv6 literal comes bracketed in the URI.
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let timed_out = || io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {uri} timed out"));
        let tcp =
            tokio::time::timeout(self.timeout, TcpStream::connect((host, port))).await.map_err(|_| timed_out())??;
        tcp.set_nodelay(true)?;
        if !https {
            return Ok(Stream::Plain(tcp));
        }
        let name = rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|_| invalid("not a TLS name"))?;
        let stream = tokio::time::timeout(self.timeout, tls::handshake(tcp, self.tls.clone(), name))
            .await
            .map_err(|_| timed_out())??;
        if stream.alpn_protocol() != Some(b"h2") {
            return Err(io::Error::new(io::ErrorKind::Unsupported, format!("{uri}: the server does not offer HTTP/2")));
        }
        Ok(Stream::Tls(Box::new(stream)))
    }
}

/// A connection's stream: h2c, or TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream>),
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
