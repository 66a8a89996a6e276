//! What connecting to a secured NATS or etcd server has in common
//! (features `nats`, `etcd`): secrets that never print, the TLS files
//! (a CA to trust, a client certificate and its key), read and checked
//! before connecting so that a bad file is an error naming its option and
//! path, and URLs shown without the credentials in them.
//!
//! What it must not do: log, print or put into an error a password, a
//! token, a seed or a private key. It holds paths and secrets only; each
//! client (`replica::connect`, `discovery::etcd::connect`) turns them into
//! its own connection options.

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::CredentialError;

/// A password or token: `Debug` prints `"***"`, never the value.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(String);

impl Secret {
    pub(crate) fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value, for the client's connection options only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

/// The option names the TLS files are reported under (the builder
/// methods' names without `with_`).
pub(crate) const TLS_CA_FILE: &str = "tls_ca_file";
pub(crate) const CLIENT_CERTIFICATE: &str = "client_certificate";
pub(crate) const CLIENT_KEY: &str = "client_key";

/// The TLS files a connection uses: paths only (not secret), read when
/// connecting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TlsFiles {
    /// PEM certificates of the CAs to trust instead of the system's.
    pub(crate) ca_file: Option<PathBuf>,
    /// A PEM certificate chain and its PEM private key, presented to a
    /// server that asks for a client certificate.
    pub(crate) client: Option<(PathBuf, PathBuf)>,
}

/// The TLS files' contents, checked: each holds what its option needs
/// (etcd's client takes the contents; NATS' reads the files itself).
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) struct TlsPem {
    pub(crate) ca: Option<Vec<u8>>,
    /// The certificate chain, then the key.
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsFiles {
    /// Whether any TLS file is set (a connection with one must use TLS).
    pub(crate) fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client.is_some()
    }

    /// Reads and checks every file set: the CA file and the client
    /// certificate must hold at least one PEM certificate each and nothing
    /// unparsable, the key file one PEM private key (PKCS#8, PKCS#1 or
    /// SEC1).
    pub(crate) fn load(&self) -> Result<TlsPem, CredentialError> {
        let ca = match &self.ca_file {
            Some(path) => Some(certificates(TLS_CA_FILE, path)?),
            None => None,
        };
        let client = match &self.client {
            Some((cert, key)) => Some((certificates(CLIENT_CERTIFICATE, cert)?, private_key(CLIENT_KEY, key)?)),
            None => None,
        };
        Ok(TlsPem { ca, client })
    }
}

/// The contents of the file at `path`, named by `option`.
pub(crate) fn read(option: &'static str, path: &Path) -> Result<Vec<u8>, CredentialError> {
    std::fs::read(path).map_err(|source| CredentialError::Unreadable {
        option,
        path: path.to_owned(),
        source,
    })
}

/// `problem` with the file `path` of `option`.
pub(crate) fn invalid(option: &'static str, path: &Path, problem: impl Into<String>) -> CredentialError {
    CredentialError::Invalid {
        option,
        path: path.to_owned(),
        problem: problem.into(),
    }
}

/// The file at `path`, if it holds one or more PEM certificates.
fn certificates(option: &'static str, path: &Path) -> Result<Vec<u8>, CredentialError> {
    let pem = read(option, path)?;
    let mut count = 0;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| invalid(option, path, format!("not valid PEM: {e}")))?;
        count += 1;
    }
    if count == 0 {
        return Err(invalid(
            option,
            path,
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok(pem)
}

/// The file at `path`, if it holds a PEM private key.
fn private_key(option: &'static str, path: &Path) -> Result<Vec<u8>, CredentialError> {
    let pem = read(option, path)?;
    // The parser's message names the PEM section, never the key's bytes.
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        invalid(
            option,
            path,
            format!("holds no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
        )
    })?;
    Ok(pem)
}

/// Where the user information (`user:password@` or `token@`) of a URL
/// such as `nats://user:password@host:4222` lies, if it has one.
fn userinfo(url: &str) -> Option<std::ops::Range<usize>> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let authority_end = url[start..].find(['/', '?', '#']).map_or(url.len(), |i| start + i);
    let at = url[start..authority_end].rfind('@')?;
    Some(start..start + at)
}

/// `url` with its user information, if any, replaced by `***`: the form
/// that goes into logs, errors and `Debug`.
pub(crate) fn redact_url(url: &str) -> String {
    match userinfo(url) {
        Some(range) => format!("{}***{}", &url[..range.start], &url[range.end..]),
        None => url.to_owned(),
    }
}

/// Splits the user information off `url`: the URL without it (and its
/// `@`), and the user information, percent-decoded, if there was one.
#[cfg(feature = "nats")]
pub(crate) fn split_url_credentials(url: &str) -> (String, Option<(String, Option<Secret>)>) {
    let Some(range) = userinfo(url) else {
        return (url.to_owned(), None);
    };
    let info = &url[range.clone()];
    let stripped = format!("{}{}", &url[..range.start], &url[range.end + 1..]);
    let credentials = match info.split_once(':') {
        Some((user, password)) => (percent_decode(user), Some(Secret::new(percent_decode(password)))),
        None => (percent_decode(info), None),
    };
    (stripped, Some(credentials))
}

/// Decodes `%XX` escapes (RFC 3986); a `%` not followed by two hex digits
/// stays as it is.
#[cfg(feature = "nats")]
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The TLS failure somewhere in `error`'s sources, if there is one: a
/// rustls error, or the I/O error a TLS stream reports when the peer
/// ends the handshake with an alert (clients report a failed handshake
/// as an I/O or transport error).
pub(crate) fn tls_failure(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            // An I/O error's `source` skips the error it wraps: look at it.
            if let Some(inner) = io.get_ref() {
                if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
                    return Some(tls.to_string());
                }
                let message = inner.to_string();
                if io.kind() == std::io::ErrorKind::InvalidData && message.contains("alert") {
                    return Some(message);
                }
            }
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "\"***\"");
        assert_eq!(s.expose(), "hunter2");
    }

    #[test]
    fn credentials_in_a_url_are_redacted() {
        assert_eq!(redact_url("nats://u:p@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_url("nats://tok@h:4222/x@y"), "nats://***@h:4222/x@y");
        assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
        assert_eq!(redact_url("u:p@h:4222"), "***@h:4222");
    }

    #[cfg(feature = "nats")]
    #[test]
    fn credentials_in_a_url_are_split_off() {
        let (url, creds) = split_url_credentials("tls://al%40ce:p%3Ass@h:4222");
        assert_eq!(url, "tls://h:4222");
        let (user, password) = creds.unwrap();
        assert_eq!(user, "al@ce");
        assert_eq!(password.unwrap().expose(), "p:ss");
        let (url, creds) = split_url_credentials("nats://s3cr3t@h");
        assert_eq!(
            (url.as_str(), creds.map(|c| (c.0, c.1.is_none()))),
            ("nats://h", Some(("s3cr3t".into(), true)))
        );
        assert_eq!(split_url_credentials("nats://h:1").1, None);
        assert_eq!(percent_decode("100%"), "100%");
    }

    #[test]
    fn tls_files_are_checked_naming_the_option_and_the_file() {
        let dir = std::env::temp_dir().join(format!("selkie-secure-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let garbage = dir.join("garbage.pem");
        std::fs::write(&garbage, "not a certificate").unwrap();
        let files = TlsFiles {
            ca_file: Some(missing.clone()),
            client: None,
        };
        let e = files.load().err().unwrap();
        assert!(
            matches!(&e, CredentialError::Unreadable { option: "tls_ca_file", path, .. } if *path == missing),
            "{e}"
        );
        let files = TlsFiles {
            ca_file: Some(garbage.clone()),
            client: None,
        };
        let e = files.load().err().unwrap();
        assert!(
            matches!(
                &e,
                CredentialError::Invalid {
                    option: "tls_ca_file",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("garbage.pem"), "{e}");
        let files = TlsFiles {
            ca_file: None,
            client: Some((missing.clone(), garbage.clone())),
        };
        assert!(matches!(
            files.load().err().unwrap(),
            CredentialError::Unreadable {
                option: "client_certificate",
                ..
            }
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
