//! Connecting to a secured NATS server: the credentials and TLS settings
//! of [`ReplicaSyncOptions`], checked before connecting and turned into
//! async-nats' connection options, and the client's connection errors
//! sorted into [`SyncError`]'s kinds.
//!
//! What it must not do: let a password, token, seed or key reach a log,
//! an error or `Debug` (they are [`Secret`]s, files are read into the
//! client's options only).

use std::path::PathBuf;

use async_nats::{ConnectErrorKind, ConnectOptions};

use super::ReplicaSyncOptions;
use crate::error::{CredentialError, SyncError};
use crate::secure::{self, Secret, TlsFiles};

/// The option names the NATS credential files are reported under.
const NKEY_SEED_FILE: &str = "nkey_seed_file";
const CREDENTIALS_FILE: &str = "credentials_file";

/// How replica sync proves who it is to the server, and how it checks the
/// server (`Debug` shows which, never a secret).
#[derive(Clone, Debug, Default)]
pub(super) struct NatsSecurity {
    auth: NatsAuth,
    tls: TlsFiles,
    tls_required: bool,
}

/// One way to authenticate; the last one set replaces the others.
#[derive(Clone, Debug, Default)]
enum NatsAuth {
    #[default]
    None,
    UserAndPassword {
        user: String,
        password: Secret,
    },
    Token(Secret),
    NKeySeedFile(PathBuf),
    CredentialsFile(PathBuf),
}

/// Connecting to a secured server: the credentials and TLS files a
/// nats-server with authentication or TLS asks for.
impl ReplicaSyncOptions {
    /// Authenticates with a user and password (the server's
    /// `authorization { user, password }` or `users` list). Replaces any
    /// token, NKey or `.creds` file set before.
    pub fn with_user_and_password(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.security.auth = NatsAuth::UserAndPassword {
            user: user.into(),
            password: Secret::new(password),
        };
        self
    }

    /// Authenticates with a token (the server's `authorization { token }`).
    /// Replaces any user and password, NKey or `.creds` file set before.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.security.auth = NatsAuth::Token(Secret::new(token));
        self
    }

    /// Authenticates with the NKey whose seed (`SU...`, as `nk -gen user`
    /// writes it) the file holds; the server lists its public key
    /// (`U...`) in `authorization { users = [{ nkey: ... }] }`. The file is
    /// read by [`ReplicaSync::connect`](super::ReplicaSync::connect).
    /// Replaces any other credential set before.
    pub fn with_nkey_seed_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.security.auth = NatsAuth::NKeySeedFile(path.into());
        self
    }

    /// Authenticates with a `.creds` file (a user JWT and its NKey seed,
    /// as `nsc generate creds` writes it), for a server in operator mode.
    /// The file is read by [`ReplicaSync::connect`](super::ReplicaSync::connect).
    /// Replaces any other credential set before.
    pub fn with_credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.security.auth = NatsAuth::CredentialsFile(path.into());
        self
    }

    /// Trusts the CAs in this PEM file (one or more certificates) instead
    /// of the system's to sign the server's certificate, and requires TLS.
    pub fn with_tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.security.tls.ca_file = Some(path.into());
        self
    }

    /// Presents this client certificate (a PEM chain) with its PEM private
    /// key to a server that verifies clients (`tls { verify: true }`), and
    /// requires TLS.
    pub fn with_client_certificate(mut self, certificate: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.security.tls.client = Some((certificate.into(), key.into()));
        self
    }

    /// Requires TLS even with no CA file or client certificate set (the
    /// server's certificate is then checked against the system's CAs), so
    /// that a server offering none is refused rather than talked to in
    /// the clear. Without it, TLS is used when the server asks for it or
    /// the URL's scheme is `tls://`.
    pub fn with_tls_required(mut self, required: bool) -> Self {
        self.security.tls_required = required;
        self
    }
}

impl NatsSecurity {
    /// Takes the credentials out of a URL such as
    /// `nats://user:password@host:4222` (or `nats://token@host`): the URL
    /// without them goes into logs and errors, they go into these options.
    /// Credentials in both the URL and the options are refused.
    pub(super) fn take_url_credentials(&mut self, url: &str) -> Result<String, SyncError> {
        let (stripped, credentials) = secure::split_url_credentials(url);
        let Some((user, password)) = credentials else {
            return Ok(stripped);
        };
        if !matches!(self.auth, NatsAuth::None) {
            return Err(CredentialError::Misplaced {
                option: "url",
                problem: format!(
                    "{} carries credentials and the options set some too: give them in one place",
                    secure::redact_url(url)
                ),
            }
            .into());
        }
        self.auth = match password {
            Some(password) => NatsAuth::UserAndPassword { user, password },
            None => NatsAuth::Token(Secret::new(user)),
        };
        Ok(stripped)
    }

    /// Reads and checks every file the options name, so that
    /// [`ReplicaSync::connect`](super::ReplicaSync::connect) fails on a bad
    /// one before it starts its thread.
    pub(super) fn check(&self) -> Result<(), CredentialError> {
        self.tls.load()?;
        self.credential_options(ConnectOptions::new()).map(drop)
    }

    /// `options` with these credentials and TLS settings (the files read
    /// again: a certificate or key replaced on disk is used from the next
    /// connection on).
    pub(super) fn apply(&self, options: ConnectOptions) -> Result<ConnectOptions, CredentialError> {
        let mut options = self.credential_options(options)?;
        if let Some(ca) = &self.tls.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls.client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        Ok(options.require_tls(self.tls_required || self.tls.is_set()))
    }

    fn credential_options(&self, options: ConnectOptions) -> Result<ConnectOptions, CredentialError> {
        Ok(match &self.auth {
            NatsAuth::None => options,
            NatsAuth::UserAndPassword { user, password } => {
                options.user_and_password(user.clone(), password.expose().to_owned())
            }
            NatsAuth::Token(token) => options.token(token.expose().to_owned()),
            NatsAuth::NKeySeedFile(path) => options.nkey(nkey_seed(path)?),
            NatsAuth::CredentialsFile(path) => {
                let creds = String::from_utf8(secure::read(CREDENTIALS_FILE, path)?)
                    .map_err(|_| secure::invalid(CREDENTIALS_FILE, path, "is not UTF-8"))?;
                // async-nats' own parser; its message does not quote the file.
                options.credentials(&creds).map_err(|e| {
                    secure::invalid(
                        CREDENTIALS_FILE,
                        path,
                        format!("not a .creds file (a NATS USER JWT and a USER NKEY SEED section): {e}"),
                    )
                })?
            }
        })
    }
}

/// The user NKey seed the file at `path` holds (its first non-empty line).
fn nkey_seed(path: &std::path::Path) -> Result<String, CredentialError> {
    let text = String::from_utf8(secure::read(NKEY_SEED_FILE, path)?)
        .map_err(|_| secure::invalid(NKEY_SEED_FILE, path, "is not UTF-8"))?;
    let seed = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    match nkeys::KeyPair::from_seed(seed) {
        Ok(pair) if pair.key_pair_type() == nkeys::KeyPairType::User => Ok(seed.to_owned()),
        // The parser's message says what is wrong with the encoding, never
        // the seed.
        Ok(_) => Err(secure::invalid(
            NKEY_SEED_FILE,
            path,
            "holds an NKey seed that is not a user's (SU...)",
        )),
        Err(e) => Err(secure::invalid(
            NKEY_SEED_FILE,
            path,
            format!("does not hold a user NKey seed (SU...): {e}"),
        )),
    }
}

/// What a failed connection attempt means: credentials refused, TLS
/// failed, or the server not there.
pub(super) fn connect_failed(server: &str, error: &async_nats::ConnectError) -> SyncError {
    let server = server.to_owned();
    let message = error.to_string();
    match error.kind() {
        ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
            SyncError::AuthenticationFailed { server, message }
        }
        ConnectErrorKind::Tls => SyncError::Tls { server, message },
        _ => match secure::tls_failure(error) {
            Some(tls) => SyncError::Tls { server, message: tls },
            None => SyncError::Unavailable {
                server,
                message: format!("cannot connect: {message}"),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_which_credential_never_the_secret() {
        let options = ReplicaSyncOptions::default().with_user_and_password("router", "hunter2");
        let shown = format!("{options:?}");
        assert!(shown.contains("router") && !shown.contains("hunter2"), "{shown}");
        let shown = format!("{:?}", ReplicaSyncOptions::default().with_token("s3cr3t-token"));
        assert!(shown.contains("Token") && !shown.contains("s3cr3t"), "{shown}");
    }

    #[test]
    fn url_credentials_move_into_the_options() {
        let mut security = NatsSecurity::default();
        let url = security
            .take_url_credentials("nats://router:hunter2@127.0.0.1:4222")
            .unwrap();
        assert_eq!(url, "nats://127.0.0.1:4222");
        assert!(matches!(&security.auth, NatsAuth::UserAndPassword { user, password }
            if user == "router" && password.expose() == "hunter2"));
        let mut security = ReplicaSyncOptions::default().with_token("t").security;
        let e = security.take_url_credentials("nats://u:hunter2@h:4222").unwrap_err();
        assert!(matches!(
            e,
            SyncError::Credentials(CredentialError::Misplaced { option: "url", .. })
        ));
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    #[test]
    fn a_bad_seed_or_creds_file_is_refused_naming_it() {
        let dir = std::env::temp_dir().join(format!("selkie-nats-connect-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.nk");
        std::fs::write(&bad, "SUnot-a-seed\n").unwrap();
        let refused = |options: ReplicaSyncOptions| options.security.check().unwrap_err();
        let e = refused(ReplicaSyncOptions::default().with_nkey_seed_file(&bad));
        assert!(
            matches!(&e, CredentialError::Invalid { option: "nkey_seed_file", path, .. } if *path == bad),
            "{e}"
        );
        assert!(!e.to_string().contains("SUnot"), "{e}");
        let e = refused(ReplicaSyncOptions::default().with_credentials_file(&bad));
        assert!(
            matches!(
                &e,
                CredentialError::Invalid {
                    option: "credentials_file",
                    ..
                }
            ),
            "{e}"
        );
        let e = refused(ReplicaSyncOptions::default().with_credentials_file(dir.join("absent.creds")));
        assert!(
            matches!(
                &e,
                CredentialError::Unreadable {
                    option: "credentials_file",
                    ..
                }
            ),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
