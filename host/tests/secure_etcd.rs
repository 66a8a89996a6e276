//! etcd discovery against etcd servers with authentication and TLS
//! (feature `etcd`).
//!
//! Each test makes its own certificates (the `openssl` CLI) and starts its
//! own `etcd` (`SELKIE_ETCD_BIN`, or `etcd` on the PATH) on free loopback
//! ports with them; then an [`EtcdRegistration`] with the right
//! credentials writes a record that an [`EtcdDiscovery`] with the right
//! credentials sees, and a client with wrong or missing ones is refused,
//! with the typed error, within its timeout. Without the binaries a test
//! prints `SKIPPED:` and returns (`SELKIE_REQUIRE_SERVERS=1` makes that a
//! failure).

mod servers;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, Permission};
use selkie::*;
use servers::secured::{self, CertFiles, Pki, TestDir};

const PREFIX: &str = "/selkie/workers/";
const TIMEOUT: Duration = Duration::from_secs(5);
const TTL: Duration = Duration::from_secs(10);

fn options() -> EtcdOptions {
    EtcdOptions::default()
        .with_timeout(TIMEOUT)
        .with_max_backoff(Duration::from_millis(200))
}

/// Registers worker `id` and waits until a discovery connected with
/// `discovery` lists it (and only it). Returns both.
fn register_and_discover(
    endpoints: &[String],
    id: u64,
    registration: EtcdOptions,
    discovery: EtcdOptions,
) -> (EtcdRegistration, EtcdDiscovery) {
    let reg = EtcdRegistration::register_with(endpoints, PREFIX, WorkerRecord::new(id), TTL, registration)
        .unwrap_or_else(|e| panic!("register: {e}"));
    let mut source =
        EtcdDiscovery::connect_with(endpoints, PREFIX, discovery).unwrap_or_else(|e| panic!("discovery: {e}"));
    let listed = source.poll().unwrap().expect("the first poll delivers the fleet");
    assert_eq!(listed, vec![WorkerRecord::new(id)]);
    (reg, source)
}

/// `connect` (and the time it took, which must be within the timeout).
fn refused<T>(what: &str, connect: impl FnOnce() -> Result<T, DiscoveryError>) -> DiscoveryError {
    let start = Instant::now();
    let e = match connect() {
        Err(e) => e,
        Ok(_) => panic!("{what} must be refused"),
    };
    assert!(
        start.elapsed() <= TIMEOUT + Duration::from_millis(500),
        "{what}: refused only after {:?}: {e}",
        start.elapsed()
    );
    e
}

fn discovery_refused(endpoints: &[String], options: EtcdOptions) -> DiscoveryError {
    refused("discovery", || EtcdDiscovery::connect_with(endpoints, PREFIX, options))
}

fn registration_refused(endpoints: &[String], id: u64, options: EtcdOptions) -> DiscoveryError {
    refused("registration", || {
        EtcdRegistration::register_with(endpoints, PREFIX, WorkerRecord::new(id), TTL, options)
    })
}

fn assert_auth_failed(e: &DiscoveryError) {
    assert!(
        matches!(e, DiscoveryError::EtcdAuthenticationFailed { .. }),
        "expected EtcdAuthenticationFailed: {e:?}"
    );
    assert!(e.to_string().contains("authentication/authorization failed"), "{e}");
    assert_eq!(e.reason(), "etcd_authentication_failed");
}

fn assert_tls_failed(e: &DiscoveryError) {
    assert!(matches!(e, DiscoveryError::EtcdTls { .. }), "expected EtcdTls: {e:?}");
    assert_eq!(e.reason(), "etcd_tls");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_user_and_password_register_and_discover_and_wrong_or_missing_ones_are_refused() {
    let test = "etcd_user_and_password";
    let Some(bin) = secured::etcd_binary(test) else { return };
    let dir = TestDir::new(test);
    // Tokens expire after a second of disuse (etcd's default is 5 minutes).
    let (_server, endpoint) = secured::start_etcd(&bin, &dir, "http", &["--auth-token-ttl", "1"]);
    let endpoints = vec![endpoint];
    // Auth on: root (etcd requires it), a `router` user that may read and
    // write the prefix, a `stranger` that may touch another prefix only.
    let rt = runtime();
    rt.block_on(async {
        let mut admin = Client::connect(&endpoints, None).await.unwrap();
        admin.user_add("root", "root-pw", None).await.unwrap();
        admin.user_grant_role("root", "root").await.unwrap();
        admin.role_add("selkie").await.unwrap();
        admin
            .role_grant_permission("selkie", Permission::read_write(PREFIX).with_prefix())
            .await
            .unwrap();
        admin.user_add("router", "router-pw", None).await.unwrap();
        admin.user_grant_role("router", "selkie").await.unwrap();
        admin.role_add("elsewhere").await.unwrap();
        admin
            .role_grant_permission("elsewhere", Permission::read_write("/elsewhere/").with_prefix())
            .await
            .unwrap();
        admin.user_add("stranger", "stranger-pw", None).await.unwrap();
        admin.user_grant_role("stranger", "elsewhere").await.unwrap();
        admin.auth_enable().await.unwrap();
    });
    let router = || options().with_user_and_password("router", "router-pw");
    let (reg, mut source) = register_and_discover(&endpoints, 1, router(), router());
    // Once the token expired, the registration's next request gets a new
    // one.
    std::thread::sleep(Duration::from_millis(2500));
    let draining = WorkerRecord::new(1).with_state(WorkerState::Draining);
    reg.update(draining.clone())
        .unwrap_or_else(|e| panic!("update after the token expired: {e}"));
    servers::wait_until("the discovery sees the update", Duration::from_secs(10), || {
        source
            .poll()
            .ok()
            .flatten()
            .is_some_and(|w| w == vec![draining.clone()])
    });

    // A wrong password, no user, a user without permission on the prefix.
    for (what, options) in [
        (
            "a wrong password",
            options().with_user_and_password("router", "wrong-pw"),
        ),
        ("no user", options()),
        (
            "a user of another prefix",
            options().with_user_and_password("stranger", "stranger-pw"),
        ),
    ] {
        let e = discovery_refused(&endpoints, options.clone());
        assert_auth_failed(&e);
        assert!(
            !format!("{e} {e:?}").contains("-pw"),
            "{what}: a password leaked: {e:?}"
        );
        let e = registration_refused(&endpoints, 2, options);
        assert_auth_failed(&e);
        assert!(
            !format!("{e} {e:?}").contains("-pw"),
            "{what}: a password leaked: {e:?}"
        );
    }
    assert!(!format!("{:?}", router()).contains("router-pw"));

    // An unauthenticated client cannot write a record: the fleet stays.
    rt.block_on(async {
        let mut anonymous = Client::connect(&endpoints, None).await.unwrap();
        let put = anonymous
            .put(
                format!("{PREFIX}3"),
                serde_json::to_vec(&WorkerRecord::new(3)).unwrap(),
                None,
            )
            .await;
        assert!(put.is_err(), "an unauthenticated put was accepted");
        let wrong = ConnectOptions::new().with_user("router", "wrong-pw");
        assert!(Client::connect(&endpoints, Some(wrong)).await.is_err());
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(source.poll().unwrap(), None, "the fleet changed");
}

/// A CA, and etcd's flags to serve TLS with a certificate it signed
/// (`client_auth`: and require client certificates signed by it).
fn tls_flags(pki: &Pki, client_auth: bool) -> (CertFiles, Vec<String>) {
    let ca = pki.ca("ca");
    let server = pki.leaf(&ca, "server");
    let mut flags = vec![
        "--cert-file".to_owned(),
        server.cert.display().to_string(),
        "--key-file".to_owned(),
        server.key.display().to_string(),
    ];
    if client_auth {
        flags.push("--client-cert-auth".to_owned());
        flags.push("--trusted-ca-file".to_owned());
        flags.push(ca.cert.display().to_string());
    }
    (ca, flags)
}

#[test]
fn tls_with_a_ca_registers_and_discovers_and_an_untrusted_server_is_refused() {
    let test = "etcd_tls_ca";
    let Some(bin) = secured::etcd_binary(test) else { return };
    let dir = TestDir::new(test);
    let Some(pki) = Pki::find(&dir, test) else { return };
    let (ca, flags) = tls_flags(&pki, false);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (_server, endpoint) = secured::start_etcd(&bin, &dir, "https", &flags);
    let endpoints = vec![endpoint.clone()];
    let trusted = || options().with_tls_ca_file(&ca.cert);
    let _pair = register_and_discover(&endpoints, 1, trusted(), trusted());

    // A CA that did not sign etcd's certificate; the system's CAs.
    let other = pki.ca("other-ca");
    assert_tls_failed(&discovery_refused(&endpoints, options().with_tls_ca_file(&other.cert)));
    assert_tls_failed(&registration_refused(
        &endpoints,
        2,
        options().with_tls_ca_file(&other.cert),
    ));
    assert_tls_failed(&discovery_refused(&endpoints, options()));

    // A plain endpoint with TLS files, a file that is not PEM: refused
    // before connecting, naming the option.
    let plain = vec![endpoint.replace("https://", "http://")];
    let e = discovery_refused(&plain, trusted());
    assert!(
        matches!(
            &e,
            DiscoveryError::EtcdCredentials(CredentialError::Misplaced {
                option: "endpoints",
                ..
            })
        ),
        "{e:?}"
    );
    let garbage = dir.write("garbage.pem", "not a certificate");
    let e = registration_refused(&endpoints, 2, options().with_tls_ca_file(&garbage));
    assert!(
        matches!(&e, DiscoveryError::EtcdCredentials(CredentialError::Invalid { option: "tls_ca_file", path, .. }) if *path == garbage),
        "{e:?}"
    );
    assert_eq!(e.reason(), "credential_invalid");
    // Credentials in an endpoint are refused, and not repeated.
    let e = discovery_refused(&[endpoint.replace("https://", "https://router:hunter2@")], trusted());
    assert!(
        matches!(&e, DiscoveryError::EtcdCredentials(CredentialError::Misplaced { .. })),
        "{e:?}"
    );
    assert!(!e.to_string().contains("hunter2"), "{e}");
}

#[test]
fn a_required_client_certificate_registers_and_discovers_and_its_absence_is_refused() {
    let test = "etcd_tls_client_cert";
    let Some(bin) = secured::etcd_binary(test) else { return };
    let dir = TestDir::new(test);
    let Some(pki) = Pki::find(&dir, test) else { return };
    let (ca, flags) = tls_flags(&pki, true);
    let client = pki.leaf(&ca, "router");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (_server, endpoint) = secured::start_etcd(&bin, &dir, "https", &flags);
    let endpoints = vec![endpoint];
    let with_cert = || {
        options()
            .with_tls_ca_file(&ca.cert)
            .with_client_certificate(&client.cert, &client.key)
    };
    let (_reg, mut source) = register_and_discover(&endpoints, 1, with_cert(), with_cert());

    // No client certificate; one signed by a CA etcd does not trust.
    let no_cert = || options().with_tls_ca_file(&ca.cert);
    assert_tls_failed(&discovery_refused(&endpoints, no_cert()));
    assert_tls_failed(&registration_refused(&endpoints, 2, no_cert()));
    let other = pki.ca("other-ca");
    let stranger = pki.leaf(&other, "stranger");
    let stranger = || {
        options()
            .with_tls_ca_file(&ca.cert)
            .with_client_certificate(&stranger.cert, &stranger.key)
    };
    assert_tls_failed(&discovery_refused(&endpoints, stranger()));
    assert_tls_failed(&registration_refused(&endpoints, 2, stranger()));
    let e = discovery_refused(
        &endpoints,
        options()
            .with_tls_ca_file(&ca.cert)
            .with_client_certificate(&client.cert, dir.join("absent.key")),
    );
    assert!(
        matches!(
            &e,
            DiscoveryError::EtcdCredentials(CredentialError::Unreadable {
                option: "client_key",
                ..
            })
        ),
        "{e:?}"
    );
    assert_eq!(source.poll().unwrap(), None, "the fleet changed");
}
