//! TLS with rustls: certificate chain and key from PEM files, ALPN `h2` then `http/1.1`.

use anyhow::Context;
use std::path::PathBuf;
use std::sync::Arc;

/// PEM files of the server's certificate chain and private key, each with the setting that named it.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The setting `cert` came from, as its errors name it: `--tls-cert`, or the config file's `tls_cert`.
    pub cert_setting: &'static str,
    /// The setting `key` came from: `--tls-key`, or the config file's `tls_key`.
    pub key_setting: &'static str,
}

impl TlsFiles {
    /// A certificate and key given as `--tls-cert` and `--tls-key`.
    pub fn new(cert: PathBuf, key: PathBuf) -> TlsFiles {
        TlsFiles { cert, key, cert_setting: "--tls-cert", key_setting: "--tls-key" }
    }
}

/// Builds the TLS acceptor.
pub fn acceptor(files: &TlsFiles) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let (cert, key) = ((files.cert_setting, files.cert.display()), (files.key_setting, files.key.display()));
    let certs = rustls_pemfile::certs(&mut std::io::BufReader::new(
        std::fs::File::open(&files.cert).with_context(|| format!("cannot open {} {}", cert.0, cert.1))?,
    ))
    .collect::<Result<Vec<_>, _>>()
    .with_context(|| format!("{} {} is not a PEM certificate chain", cert.0, cert.1))?;
    anyhow::ensure!(!certs.is_empty(), "{} {} holds no certificate", cert.0, cert.1);
    let key = rustls_pemfile::private_key(&mut std::io::BufReader::new(
        std::fs::File::open(&files.key).with_context(|| format!("cannot open {} {}", key.0, key.1))?,
    ))
    .with_context(|| format!("{} {} is not a PEM private key", key.0, key.1))?
    .with_context(|| format!("{} {} holds no private key", key.0, key.1))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file's errors name the setting that gave it: the flag, or the config file's key.
    #[test]
    fn errors_name_the_setting_that_gave_the_file() {
        let acceptor = |files: &TlsFiles| acceptor(files).map(|_| ());
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        let e = acceptor(&TlsFiles::new(cert.clone(), key.clone())).unwrap_err().to_string();
        assert!(e.starts_with("cannot open --tls-cert "), "{e}");
        let from_config = TlsFiles { cert_setting: "tls_cert", key_setting: "tls_key", ..TlsFiles::new(cert, key) };
        let e = acceptor(&from_config).unwrap_err().to_string();
        assert!(e.starts_with("cannot open tls_cert ") && !e.contains("--"), "{e}");
        std::fs::write(&from_config.cert, "no PEM here").unwrap();
        let e = acceptor(&from_config).unwrap_err().to_string();
        assert!(e.starts_with("tls_cert ") && e.ends_with("holds no certificate"), "{e}");
    }
}
