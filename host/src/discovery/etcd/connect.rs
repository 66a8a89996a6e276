//! Connecting to a secured etcd: the user, password and TLS files of
//! [`EtcdOptions`], checked before connecting and turned into
//! etcd-client's connection options, and etcd's refusals sorted into
//! [`DiscoveryError`]'s kinds.
//!
//! What it must not do: let a password or key reach a log, an error or
//! `Debug` (the password is a [`Secret`]; files are read into the client's
//! options only).

use std::path::PathBuf;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use super::EtcdOptions;
use crate::error::{CredentialError, DiscoveryError};
use crate::secure::{self, Secret, TlsFiles};

/// How the client proves who it is to etcd, and how it checks etcd
/// (`Debug` shows which, never the password).
#[derive(Clone, Debug, Default)]
pub(super) struct EtcdSecurity {
    user: Option<(String, Secret)>,
    tls: TlsFiles,
}

/// Connecting to a secured etcd: the user, password and TLS files an etcd
/// with authentication or TLS asks for.
impl EtcdOptions {
    /// Authenticates as this etcd user (etcd's `--auth` on, a user made
    /// with `etcdctl user add`): the client asks etcd for a token with
    /// them and renews it when it expires. The user needs read access to
    /// the watched prefix ([`EtcdDiscovery`](crate::EtcdDiscovery)) or
    /// write access to the worker's key ([`EtcdRegistration`](crate::EtcdRegistration)).
    pub fn with_user_and_password(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.security.user = Some((user.into(), Secret::new(password)));
        self
    }

    /// Trusts the CAs in this PEM file (one or more certificates) instead
    /// of the system's to sign etcd's certificate (etcd's
    /// `--cert-file`). Needs `https://` endpoints.
    pub fn with_tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.security.tls.ca_file = Some(path.into());
        self
    }

    /// Presents this client certificate (a PEM chain) with its PEM private
    /// key to an etcd that verifies clients (`--client-cert-auth` with
    /// `--trusted-ca-file`). Needs `https://` endpoints.
    pub fn with_client_certificate(mut self, certificate: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.security.tls.client = Some((certificate.into(), key.into()));
        self
    }
}

impl EtcdSecurity {
    /// Whether a connection to `endpoints` uses TLS (etcd-client's rule:
    /// `https://`, or TLS options with an endpoint without a scheme).
    pub(super) fn uses_tls(&self, endpoints: &[String]) -> bool {
        self.tls.is_set() || endpoints.iter().any(|e| e.starts_with("https://"))
    }

    /// Checks the endpoints against these settings and reads every file
    /// they name, so that a bad one fails `connect` or `register` before
    /// a thread starts: no user information in an endpoint (it would
    /// reach logs and errors), and no TLS file with a plain `http://`
    /// endpoint.
    pub(super) fn check(&self, endpoints: &[String]) -> Result<(), DiscoveryError> {
        for endpoint in endpoints {
            if secure::redact_url(endpoint) != *endpoint {
                return Err(CredentialError::Misplaced {
                    option: "endpoints",
                    problem: format!(
                        "{} carries credentials: give them with EtcdOptions::with_user_and_password",
                        secure::redact_url(endpoint)
                    ),
                }
                .into());
            }
            if self.tls.is_set() && endpoint.starts_with("http://") {
                return Err(CredentialError::Misplaced {
                    option: "endpoints",
                    problem: format!(
                        "{endpoint} is plain HTTP but a TLS CA or client certificate is set: use https://"
                    ),
                }
                .into());
            }
        }
        self.tls.load()?;
        Ok(())
    }

    /// `options` with this user and, for `https://` endpoints or with TLS
    /// files, TLS (the files read again: a certificate or key replaced on
    /// disk is used from the next connection on; without a CA file etcd's
    /// certificate is checked against the system's CAs).
    fn apply(
        &self,
        mut options: ConnectOptions,
        endpoints: &[String],
        timeout: Duration,
    ) -> Result<ConnectOptions, CredentialError> {
        if let Some((user, password)) = &self.user {
            // etcd's tokens expire (5 minutes unused by default): the
            // client asks for a new one and retries the request.
            options = options
                .with_user(user.clone(), password.expose())
                .with_auto_token_refresh(true);
        }
        if !self.uses_tls(endpoints) {
            return Ok(options);
        }
        let pem = self.tls.load()?;
        let mut tls = TlsOptions::new().timeout(timeout);
        tls = match pem.ca {
            Some(ca) => tls.ca_certificate(Certificate::from_pem(ca)),
            None => tls.with_native_roots(),
        };
        if let Some((cert, key)) = pem.client {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        Ok(options.with_tls(tls))
    }
}

/// Why talking to etcd failed, sorted: credentials refused, TLS failed,
/// or etcd not there (the message says what was being done); or a file
/// of the options that became unusable since `connect` checked it.
#[derive(Debug)]
pub(super) enum Failure {
    Etcd { kind: FailureKind, message: String },
    Credentials(CredentialError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FailureKind {
    Unavailable,
    Authentication,
    Tls,
    /// etcd closed the connection under a request.
    Closed,
}

impl Failure {
    /// etcd-client's `error` while doing `what`.
    pub(super) fn etcd(what: impl std::fmt::Display, error: &etcd_client::Error) -> Failure {
        let kind = if refused(error) {
            FailureKind::Authentication
        } else if secure::tls_failure(inner(error)).is_some() {
            FailureKind::Tls
        } else if closed(error) {
            FailureKind::Closed
        } else {
            FailureKind::Unavailable
        };
        Failure::Etcd {
            kind,
            message: format!("{what}: {error}"),
        }
    }

    /// The public error for `endpoints` (comma-separated) when `connect`
    /// or `register` fails, over TLS or not. etcd ends the TLS connection
    /// of a client whose certificate it refuses (or that has none) right
    /// after the handshake, and the client reads the alert saying so only
    /// if it comes before its first request hits the closed connection:
    /// with TLS, a connection closed under that first request is taken as
    /// that refusal.
    pub(super) fn into_start_error(self, endpoints: &str, tls: bool) -> DiscoveryError {
        match self {
            Failure::Etcd {
                kind: FailureKind::Closed,
                message,
            } if tls => DiscoveryError::EtcdTls {
                endpoints: endpoints.to_owned(),
                message: format!(
                    "{message} (etcd closed the TLS connection at the first request: it refused this client's \
                     certificate, or its absence)"
                ),
            },
            other => other.into_error(endpoints),
        }
    }

    /// The public error for `endpoints` (comma-separated).
    pub(super) fn into_error(self, endpoints: &str) -> DiscoveryError {
        let endpoints = endpoints.to_owned();
        match self {
            Failure::Credentials(e) => DiscoveryError::EtcdCredentials(e),
            Failure::Etcd { kind, message } => match kind {
                FailureKind::Unavailable | FailureKind::Closed => {
                    DiscoveryError::EtcdUnavailable { endpoints, message }
                }
                FailureKind::Authentication => DiscoveryError::EtcdAuthenticationFailed { endpoints, message },
                FailureKind::Tls => DiscoveryError::EtcdTls { endpoints, message },
            },
        }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::Etcd {
            kind: FailureKind::Unavailable,
            message,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Etcd { message, .. } => f.write_str(message),
            Failure::Credentials(e) => e.fmt(f),
        }
    }
}

/// Whether etcd refused the client's credentials or permissions: a wrong
/// user or password, none where etcd requires one, an expired token, a
/// user without permission on the key.
fn refused(error: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(status) = error else {
        return false;
    };
    match i32::from(status.code()) {
        tonic_code::UNAUTHENTICATED | tonic_code::PERMISSION_DENIED => true,
        // etcd answers a bad password, and a request without a user while
        // auth is on, with "invalid argument".
        tonic_code::INVALID_ARGUMENT => {
            let m = status.message();
            m.contains("authentication failed") || m.contains("user name is empty")
        }
        _ => false,
    }
}

/// gRPC status codes, as numbers (etcd-client does not re-export tonic's
/// `Code`).
mod tonic_code {
    pub(super) const CANCELLED: i32 = 1;
    pub(super) const INVALID_ARGUMENT: i32 = 3;
    pub(super) const PERMISSION_DENIED: i32 = 7;
    pub(super) const UNAUTHENTICATED: i32 = 16;
}

/// Whether the connection was closed under the request: the request was
/// canceled (this client never cancels one) or the socket broke.
fn closed(error: &etcd_client::Error) -> bool {
    if let etcd_client::Error::GRpcStatus(status) = error {
        if i32::from(status.code()) == tonic_code::CANCELLED {
            return true;
        }
    }
    let mut next = Some(inner(error));
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
            if matches!(
                io.kind(),
                BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof
            ) {
                return true;
            }
        }
        next = e.source();
    }
    false
}

/// The error etcd-client's `error` wraps (its own `source` is none).
fn inner(error: &etcd_client::Error) -> &(dyn std::error::Error + 'static) {
    match error {
        etcd_client::Error::GRpcStatus(status) => status,
        etcd_client::Error::TransportError(e) => e,
        etcd_client::Error::IoError(e) => e,
        other => other,
    }
}

/// Connects a client with the options' timeouts, credentials and TLS
/// settings, and HTTP/2 keep-alive (so a silent server is noticed, not
/// waited on). With a user, connecting asks etcd for a token, so wrong
/// credentials fail here.
pub(super) async fn connect(endpoints: &[String], options: &EtcdOptions) -> Result<Client, Failure> {
    let connect_options = ConnectOptions::new()
        .with_connect_timeout(options.timeout)
        .with_timeout(options.timeout)
        .with_keep_alive(options.timeout, options.timeout);
    let connect_options = options
        .security
        .apply(connect_options, endpoints, options.timeout)
        .map_err(Failure::Credentials)?;
    match tokio::time::timeout(options.timeout, Client::connect(endpoints, Some(connect_options))).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(Failure::etcd("cannot connect", &e)),
        Err(_) => Err(format!("cannot connect within {:?}", options.timeout).into()),
    }
}
