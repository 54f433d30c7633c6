//! TLS with rustls: certificate chain and key from PEM files, ALPN `h2` then `http/1.1`.

use anyhow::Context;
use std::path::PathBuf;
use std::sync::Arc;

/// PEM files of the server's certificate chain and private key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Builds the TLS acceptor.
pub fn acceptor(files: &TlsFiles) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let certs = rustls_pemfile::certs(&mut std::io::BufReader::new(
        std::fs::File::open(&files.cert).with_context(|| format!("cannot open --tls-cert {}", files.cert.display()))?,
    ))
    .collect::<Result<Vec<_>, _>>()
    .with_context(|| format!("--tls-cert {} is not a PEM certificate chain", files.cert.display()))?;
    anyhow::ensure!(!certs.is_empty(), "--tls-cert {} holds no certificate", files.cert.display());
    let key = rustls_pemfile::private_key(&mut std::io::BufReader::new(
        std::fs::File::open(&files.key).with_context(|| format!("cannot open --tls-key {}", files.key.display()))?,
    ))
    .with_context(|| format!("--tls-key {} is not a PEM private key", files.key.display()))?
    .with_context(|| format!("--tls-key {} holds no private key", files.key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the TLS certificate and key do not match")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
