//! The connections under the HTTP/2 client: TCP, and for `https://` servers TLS (rustls, ALPN `h2`,
//! the web's roots plus `ca_file`) over a socket read ahead in large pieces.
//!
//! rustls reads its socket at most 4 KiB past what it holds, so a TLS body came in 15 KB `recv` calls,
//! each with its fixed cost and often an ACK: 146,500 calls for a 2.2 GB epoch where h2c makes 67,700.
//! [`ReadAhead`] takes what the socket has, up to [`READ_AHEAD`] at once, and hands rustls its small
//! reads from memory: 40,900 calls, and 7 % less of the daemon's CPU under DALI (docs/BENCHMARKS.md).
//! Reading further ahead did worse: with 256 KiB the connection ran ahead of the bodies' writers, whose
//! copies into the memory files then cost several times as much (the bytes out of the CPU's caches, it
//! seems), and the daemon held about 90 MB more (64 KiB: 35 MB more).
//! h2c needs none: HTTP/2 itself reads up to the end of each frame.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Bytes a TLS connection's socket is read in at most at once.
pub const READ_AHEAD: usize = 64 << 10;

/// Makes the connections of one client: `tls` for `https://` URLs.
#[derive(Clone)]
pub struct Connector {
    tls: tokio_rustls::TlsConnector,
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
        Ok(Connector { tls: tokio_rustls::TlsConnector::from(Arc::new(config)), timeout })
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
        let stream = tokio::time::timeout(self.timeout, self.tls.connect(name, ReadAhead::new(tcp)))
            .await
            .map_err(|_| timed_out())??;
        if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Err(io::Error::new(io::ErrorKind::Unsupported, format!("{uri}: the server does not offer HTTP/2")));
        }
        Ok(Stream::Tls(Box::new(stream)))
    }
}

/// A socket read in pieces of up to [`READ_AHEAD`]: reads shorter than that are served from what the
/// last `recv` brought. Writes go straight through.
pub struct ReadAhead {
    stream: TcpStream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl ReadAhead {
    pub fn new(stream: TcpStream) -> Self {
        ReadAhead { stream, buf: vec![0; READ_AHEAD].into_boxed_slice(), start: 0, end: 0 }
    }
}

impl AsyncRead for ReadAhead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.start == this.end {
            if out.remaining() >= this.buf.len() {
                return Pin::new(&mut this.stream).poll_read(cx, out);
            }
            let mut fill = ReadBuf::new(&mut this.buf);
            ready!(Pin::new(&mut this.stream).poll_read(cx, &mut fill))?;
            (this.start, this.end) = (0, fill.filled().len());
        }
        let n = out.remaining().min(this.end - this.start);
        out.put_slice(&this.buf[this.start..this.start + n]);
        this.start += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ReadAhead {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// A connection's stream: h2c, or TLS over a socket read ahead.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<ReadAhead>>),
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Reads of every size through the read-ahead see the socket's bytes in order, whole, up to its end:
    /// small reads from the buffer, reads of a whole buffer or more straight from the socket.
    #[tokio::test]
    async fn read_ahead_hands_on_every_byte_in_order() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
        let sent = data.clone();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for piece in sent.chunks(70_001) {
                s.write_all(piece).await.unwrap();
            }
        });
        let mut reader = ReadAhead::new(TcpStream::connect(addr).await.unwrap());
        let (mut got, mut k) = (Vec::new(), 0usize);
        loop {
            let size = [1, 4096, 16_709, READ_AHEAD, READ_AHEAD + 1, 77][k % 6];
            k += 1;
            let mut buf = vec![0; size];
            let n = reader.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got.len(), data.len());
        assert!(got == data, "the bytes differ");
    }
}
