//! Replica sync against nats-servers with authentication and TLS (feature
//! `nats`).
//!
//! Each test makes its own credentials and certificates (the `openssl`
//! CLI, the `nkeys` crate for NKeys and JWTs) and starts its own
//! `nats-server` (`SELKIE_NATS_BIN`, or `nats-server` on the PATH) on a
//! free loopback port with them; then two replicas with the right
//! credentials exchange a load, and a client with wrong or missing ones is
//! refused, with the typed error, well within its connect timeout. Without
//! the binaries a test prints `SKIPPED:` and returns
//! (`SELKIE_REQUIRE_SERVERS=1` makes that a failure).

mod servers;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use futures_util::StreamExt;
use nkeys::KeyPair;
use selkie::*;
use servers::secured::{self, CertFiles, Pki, TestDir};

const SUBJECT: &str = "selkie.bookings.secured";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const LONG: Duration = Duration::from_secs(10);

fn fast() -> ReplicaSyncOptions {
    ReplicaSyncOptions::default()
        .with_subject(SUBJECT)
        .with_batch_interval(Duration::from_millis(2))
        .with_heartbeat_interval(Duration::from_millis(50))
        .with_peer_timeout(Duration::from_millis(600))
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_max_reconnect_delay(Duration::from_millis(100))
}

const WORKER: WorkerWithDpRank = WorkerWithDpRank {
    worker_id: 7,
    dp_rank: 0,
};
const LOAD: RemoteLoad = RemoteLoad {
    requests: 3,
    prefill_tokens: 4096,
    decode_blocks: 48,
};

/// Two replicas connect with their options; A reports a load and B sees
/// it. Returns them for more checks.
fn exchange(url: &str, a: ReplicaSyncOptions, b: ReplicaSyncOptions) -> (ReplicaSync, ReplicaSync) {
    let a = ReplicaSync::connect(url, a).unwrap_or_else(|e| panic!("replica A: {e}"));
    let b = ReplicaSync::connect(url, b).unwrap_or_else(|e| panic!("replica B: {e}"));
    a.report_load(WORKER, LOAD);
    servers::wait_until("B sees A's load", LONG, || b.remote_load(WORKER) == LOAD);
    (a, b)
}

/// Connecting with `options` fails, and before the connect timeout runs
/// out (a refusal is not a hang).
fn refused(url: &str, options: ReplicaSyncOptions) -> SyncError {
    let start = Instant::now();
    let e = ReplicaSync::connect(url, options).expect_err("connect must be refused");
    assert!(
        start.elapsed() < CONNECT_TIMEOUT,
        "refused only after {:?}: {e}",
        start.elapsed()
    );
    e
}

fn assert_auth_failed(e: &SyncError, url: &str) {
    assert!(
        matches!(e, SyncError::AuthenticationFailed { server, .. } if server == url),
        "expected AuthenticationFailed naming {url}: {e:?}"
    );
    assert!(e.to_string().contains("authentication/authorization failed"), "{e}");
    assert_eq!(e.reason(), "authentication_failed");
}

fn assert_tls_failed(e: &SyncError, url: &str) {
    assert!(
        matches!(e, SyncError::Tls { server, .. } if server == url),
        "expected Tls naming {url}: {e:?}"
    );
}

fn url(server: &secured::OwnServer) -> String {
    format!("nats://127.0.0.1:{}", server.port)
}

#[test]
fn user_and_password_connect_and_a_wrong_or_missing_password_is_refused() {
    let test = "nats_user_and_password";
    let Some(bin) = secured::nats_binary(test) else { return };
    let dir = TestDir::new(test);
    let server = secured::start_nats(
        &bin,
        &dir,
        r#"authorization { users = [ { user: router, password: "router-pw" } ] }"#,
    );
    let url = url(&server);
    let router = || fast().with_user_and_password("router", "router-pw");
    let _pair = exchange(&url, router(), router());

    let e = refused(&url, fast().with_user_and_password("router", "wrong-pw"));
    assert_auth_failed(&e, &url);
    assert!(!format!("{e} {e:?}").contains("wrong-pw"), "the password leaked: {e:?}");
    assert_auth_failed(&refused(&url, fast()), &url);

    // The same credentials in the URL work, and stay out of `server()`,
    // `Debug` and errors.
    let in_url = url.replace("nats://", "nats://router:router-pw@");
    let c = ReplicaSync::connect(&in_url, fast()).unwrap();
    assert_eq!(c.server(), url);
    assert!(!format!("{c:?}").contains("router-pw"));
    let wrong_in_url = url.replace("nats://", "nats://router:wrong-pw@");
    let e = refused(&wrong_in_url, fast());
    assert_auth_failed(&e, &url);
    assert!(!format!("{e} {e:?}").contains("wrong-pw"), "the password leaked: {e:?}");
}

#[test]
fn a_token_connects_and_a_wrong_one_is_refused() {
    let test = "nats_token";
    let Some(bin) = secured::nats_binary(test) else { return };
    let dir = TestDir::new(test);
    let server = secured::start_nats(&bin, &dir, r#"authorization { token: "s3cr3t-token" }"#);
    let url = url(&server);
    let _pair = exchange(
        &url,
        fast().with_token("s3cr3t-token"),
        fast().with_token("s3cr3t-token"),
    );
    let e = refused(&url, fast().with_token("not-the-token"));
    assert_auth_failed(&e, &url);
    assert!(!format!("{e:?}").contains("not-the-token"));
    assert_auth_failed(&refused(&url, fast()), &url);
}

#[test]
fn an_nkey_seed_file_connects_and_an_unknown_nkey_is_refused() {
    let test = "nats_nkey";
    let Some(bin) = secured::nats_binary(test) else { return };
    let dir = TestDir::new(test);
    let user = KeyPair::new_user();
    let seed = dir.write("router.nk", user.seed().unwrap() + "\n");
    let server = secured::start_nats(
        &bin,
        &dir,
        &format!("authorization {{ users = [ {{ nkey: {} }} ] }}", user.public_key()),
    );
    let url = url(&server);
    let _pair = exchange(
        &url,
        fast().with_nkey_seed_file(&seed),
        fast().with_nkey_seed_file(&seed),
    );

    let stranger = dir.write("stranger.nk", KeyPair::new_user().seed().unwrap());
    assert_auth_failed(&refused(&url, fast().with_nkey_seed_file(&stranger)), &url);

    // A file that holds no seed, or none at all: refused before
    // connecting, naming the option and the file.
    let bad = dir.write("bad.nk", "SUAnot-a-seed");
    let e = refused(&url, fast().with_nkey_seed_file(&bad));
    assert!(
        matches!(&e, SyncError::Credentials(CredentialError::Invalid { option: "nkey_seed_file", path, .. }) if *path == bad),
        "{e:?}"
    );
    let missing = dir.join("missing.nk");
    let e = refused(&url, fast().with_nkey_seed_file(&missing));
    assert!(
        matches!(&e, SyncError::Credentials(CredentialError::Unreadable { option: "nkey_seed_file", path, .. }) if *path == missing),
        "{e:?}"
    );
    assert!(e.to_string().contains("missing.nk"), "{e}");
}

/// A JWT as `nsc` makes them: ed25519-nkey, signed by `issuer`.
fn jwt(issuer: &KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let header = URL_SAFE_NO_PAD.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": format!("SELKIETEST{}", now.as_nanos()),
        "iat": now.as_secs(),
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let body = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signature = issuer.sign(format!("{header}.{body}").as_bytes()).unwrap();
    format!("{header}.{body}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// A `.creds` file for `user`, whose JWT `account` signed.
fn creds(dir: &TestDir, name: &str, account: &KeyPair, user: &KeyPair) -> std::path::PathBuf {
    let user_jwt = jwt(
        account,
        &user.public_key(),
        name,
        serde_json::json!({"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}),
    );
    dir.write(
        &format!("{name}.creds"),
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed().unwrap()
        ),
    )
}

#[test]
fn a_creds_file_connects_in_operator_mode_and_an_untrusted_account_is_refused() {
    let test = "nats_creds";
    let Some(bin) = secured::nats_binary(test) else { return };
    let dir = TestDir::new(test);
    // Operator mode with a memory resolver: the operator signs the
    // account, the account signs the user, the server trusts the operator.
    let operator = KeyPair::new_operator();
    let account = KeyPair::new_account();
    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "selkie-test-operator",
        serde_json::json!({"type": "operator", "version": 2}),
    );
    let limits = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
    });
    let account_jwt = jwt(
        &operator,
        &account.public_key(),
        "SELKIE",
        serde_json::json!({"limits": limits, "type": "account", "version": 2}),
    );
    let server = secured::start_nats(
        &bin,
        &dir,
        &format!(
            "operator: \"{operator_jwt}\"\nresolver: MEMORY\nresolver_preload: {{\n  {}: \"{account_jwt}\"\n}}",
            account.public_key()
        ),
    );
    let url = url(&server);
    let router = creds(&dir, "router", &account, &KeyPair::new_user());
    let _pair = exchange(
        &url,
        fast().with_credentials_file(&router),
        fast().with_credentials_file(&router),
    );

    // A user of an account the operator never signed.
    let stranger = creds(&dir, "stranger", &KeyPair::new_account(), &KeyPair::new_user());
    assert_auth_failed(&refused(&url, fast().with_credentials_file(&stranger)), &url);
    assert_auth_failed(&refused(&url, fast()), &url);

    let bad = dir.write("bad.creds", "no JWT here");
    let e = refused(&url, fast().with_credentials_file(&bad));
    assert!(
        matches!(&e, SyncError::Credentials(CredentialError::Invalid { option: "credentials_file", path, .. }) if *path == bad),
        "{e:?}"
    );
}

/// A CA, a server certificate it signed, and a TLS block for nats-server
/// (`verify`: require client certificates signed by the CA).
fn tls_server(pki: &Pki, verify: bool) -> (CertFiles, String) {
    let ca = pki.ca("ca");
    let server = pki.leaf(&ca, "server");
    let block = format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: {verify}\n  timeout: 2\n}}",
        server.cert.display(),
        server.key.display(),
        ca.cert.display()
    );
    (ca, block)
}

#[test]
fn tls_with_a_ca_connects_and_an_untrusted_server_is_refused() {
    let test = "nats_tls_ca";
    let Some(bin) = secured::nats_binary(test) else { return };
    let dir = TestDir::new(test);
    let Some(pki) = Pki::find(&dir, test) else { return };
    let (ca, block) = tls_server(&pki, false);
    let server = secured::start_nats(&bin, &dir, &block);
    let url = url(&server);
    let trusted = || fast().with_tls_ca_file(&ca.cert);
    let _pair = exchange(&url, trusted(), trusted());

    // A CA that did not sign the server's certificate.
    let other = pki.ca("other-ca");
    let e = refused(&url, fast().with_tls_ca_file(&other.cert));
    assert_tls_failed(&e, &url);
    assert_eq!(e.reason(), "tls");
    // Without a CA file the system's CAs do not know the test's CA either.
    assert_tls_failed(&refused(&url, fast()), &url);

    let garbage = dir.write(
        "garbage.pem",
        "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
    );
    let e = refused(&url, fast().with_tls_ca_file(&garbage));
    assert!(
        matches!(&e, SyncError::Credentials(CredentialError::Invalid { option: "tls_ca_file", path, .. }) if *path == garbage),
        "{e:?}"
    );
}

#[test]
fn a_required_client_certificate_connects_and_its_absence_is_refused() {
    let test = "nats_tls_client_cert";
    let Some(bin) = secured::nats_binary(test) else { return };
    let dir = TestDir::new(test);
    let Some(pki) = Pki::find(&dir, test) else { return };
    let (ca, block) = tls_server(&pki, true);
    let client = pki.leaf(&ca, "router");
    let server = secured::start_nats(&bin, &dir, &block);
    let url = url(&server);
    let with_cert = || {
        fast()
            .with_tls_ca_file(&ca.cert)
            .with_client_certificate(&client.cert, &client.key)
    };
    let _pair = exchange(&url, with_cert(), with_cert());

    // No client certificate, and one signed by a CA the server does not
    // trust: the server ends the handshake.
    assert_tls_failed(&refused(&url, fast().with_tls_ca_file(&ca.cert)), &url);
    let other = pki.ca("other-ca");
    let stranger = pki.leaf(&other, "stranger");
    let e = refused(
        &url,
        fast()
            .with_tls_ca_file(&ca.cert)
            .with_client_certificate(&stranger.cert, &stranger.key),
    );
    assert_tls_failed(&e, &url);
    // A key file that holds no key.
    let e = refused(
        &url,
        fast()
            .with_tls_ca_file(&ca.cert)
            .with_client_certificate(&client.cert, &ca.cert),
    );
    assert!(
        matches!(
            &e,
            SyncError::Credentials(CredentialError::Invalid {
                option: "client_key",
                ..
            })
        ),
        "{e:?}"
    );
}

/// A raw async-nats client on a runtime of the test's own.
struct Raw {
    rt: tokio::runtime::Runtime,
}

impl Raw {
    fn new() -> Raw {
        Raw {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    fn connect(&self, url: &str, user: Option<(&str, &str)>) -> Result<async_nats::Client, async_nats::ConnectError> {
        let mut options = async_nats::ConnectOptions::new().connection_timeout(CONNECT_TIMEOUT);
        if let Some((u, p)) = user {
            options = options.user_and_password(u.into(), p.into());
        }
        self.rt.block_on(options.connect(url))
    }
}

#[test]
fn an_unauthenticated_or_unpermitted_publisher_changes_nothing() {
    let test = "nats_forged_publisher";
    let Some(bin) = secured::nats_binary(test) else { return };
    let dir = TestDir::new(test);
    // Routers may publish and subscribe; a reader only subscribe.
    let server = secured::start_nats(
        &bin,
        &dir,
        r#"authorization { users = [
             { user: router, password: "router-pw" }
             { user: reader, password: "reader-pw", permissions: { publish: { deny: [">"] }, subscribe: { allow: [">"] } } }
           ] }"#,
    );
    let url = url(&server);
    let router = || fast().with_user_and_password("router", "router-pw");
    let (_a, b) = exchange(&url, router(), router());
    let forged_worker = WorkerWithDpRank::new(8, 0);
    let forged = serde_json::json!({"r": 777, "i": 1, "s": 1, "m": {"d": [
        {"L": [WORKER.worker_id, 0, [100000, 0, 0]]},
        {"L": [forged_worker.worker_id, 0, [100000, 0, 0]]},
    ]}})
    .to_string();

    let raw = Raw::new();
    // Without credentials there is no connection to publish on.
    let e = raw
        .connect(&url, None)
        .expect_err("an unauthenticated client must be refused");
    assert_eq!(e.kind(), async_nats::ConnectErrorKind::AuthorizationViolation, "{e}");

    // A reader's publication is dropped by the server: a router's
    // subscriber sees a router's marker but never the reader's message.
    let watcher = raw.connect(&url, Some(("router", "router-pw"))).unwrap();
    let reader = raw.connect(&url, Some(("reader", "reader-pw"))).unwrap();
    let marker = "selkie-test-marker";
    let seen = raw.rt.block_on(async {
        let mut sub = watcher.subscribe(SUBJECT).await.unwrap();
        watcher.flush().await.unwrap();
        reader.publish(SUBJECT, forged.clone().into()).await.unwrap();
        reader.flush().await.unwrap();
        watcher.publish(SUBJECT, marker.into()).await.unwrap();
        watcher.flush().await.unwrap();
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        while let Ok(Some(m)) = tokio::time::timeout_at(deadline, sub.next()).await {
            seen.push(String::from_utf8_lossy(&m.payload).into_owned());
        }
        seen
    });
    assert!(seen.iter().any(|m| m == marker), "the subscriber saw nothing: {seen:?}");
    assert!(!seen.contains(&forged), "the reader's message was delivered");

    // B kept A's load and nothing else.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(b.remote_load(WORKER), LOAD);
    assert_eq!(b.remote_load(forged_worker), RemoteLoad::default());
    assert_eq!(b.remote_loads(), vec![(WORKER, LOAD)]);
}
