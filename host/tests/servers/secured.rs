//! Servers with authentication and TLS, for the tests of secured
//! connections: certificates made now with the `openssl` CLI (a CA, a
//! server certificate for 127.0.0.1, client certificates) in a directory
//! of the test's own, and a `nats-server` or `etcd` started from its
//! binary with a configuration written there. Everything is removed and
//! killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A directory of the test's own, removed on drop.
pub struct TestDir(pub PathBuf);

impl TestDir {
    pub fn new(test: &str) -> TestDir {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("selkie-{test}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A certificate and its private key, as PEM files.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Certificates made with the `openssl` CLI: EC P-256 keys (PKCS#8),
/// valid for a day.
pub struct Pki<'a> {
    dir: &'a TestDir,
    openssl: PathBuf,
}

impl<'a> Pki<'a> {
    /// `None` (after printing why `test` is skipped) without `openssl`.
    pub fn find(dir: &'a TestDir, test: &str) -> Option<Pki<'a>> {
        match super::server_binary("SELKIE_OPENSSL_BIN", "openssl") {
            Some(openssl) => Some(Pki { dir, openssl }),
            None => {
                super::skip(&format!("{test}: needs the openssl CLI (Debian: openssl)"));
                None
            }
        }
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new(&self.openssl)
            .args(args)
            .current_dir(&self.dir.0)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn key(&self, name: &str) -> PathBuf {
        let key = format!("{name}.key");
        self.openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            &key,
        ]);
        self.dir.join(&key)
    }

    /// A self-signed CA named `name`.
    pub fn ca(&self, name: &str) -> CertFiles {
        let key = self.key(name);
        let cert = format!("{name}.pem");
        self.openssl(&[
            "req",
            "-x509",
            "-new",
            "-key",
            key.to_str().unwrap(),
            "-out",
            &cert,
            "-days",
            "1",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        CertFiles {
            cert: self.dir.join(&cert),
            key,
        }
    }

    /// A certificate for `name` signed by `ca`, for 127.0.0.1 and
    /// localhost, good for a server and a client.
    pub fn leaf(&self, ca: &CertFiles, name: &str) -> CertFiles {
        let key = self.key(name);
        let csr = format!("{name}.csr");
        let cert = format!("{name}.pem");
        let ext = self.dir.write(
            &format!("{name}.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyAgreement\n\
             extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
        );
        self.openssl(&[
            "req",
            "-new",
            "-key",
            key.to_str().unwrap(),
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ]);
        let serial = format!("{}", SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos());
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            ca.cert.to_str().unwrap(),
            "-CAkey",
            ca.key.to_str().unwrap(),
            "-set_serial",
            &serial,
            "-days",
            "1",
            "-out",
            &cert,
            "-extfile",
            ext.to_str().unwrap(),
        ]);
        CertFiles {
            cert: self.dir.join(&cert),
            key,
        }
    }
}

/// Waits up to 20 s until something accepts connections on `port`.
fn wait_for_port(port: u16, child: &mut Child, what: &str, log: &Path) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let start = Instant::now();
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{what} exited ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what} does not accept connections"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A server process of the test's own; killed on drop.
pub struct OwnServer {
    child: Child,
    pub port: u16,
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server binary in `var` or on the PATH as `name`, or `None` after
/// printing why `test` is skipped.
fn binary(var: &str, name: &str, test: &str, package: &str) -> Option<PathBuf> {
    let bin = super::server_binary(var, name);
    if bin.is_none() {
        super::skip(&format!(
            "{test}: needs a {name} binary ({var} or `{name}` on the PATH; Debian: {package})"
        ));
    }
    bin
}

/// The `nats-server` binary, or `None` after printing why `test` is
/// skipped.
pub fn nats_binary(test: &str) -> Option<PathBuf> {
    binary("SELKIE_NATS_BIN", "nats-server", test, "nats-server")
}

/// Starts `bin` with `config` (nats-server's configuration format, less
/// the `listen` line, which this adds) on a free loopback port, and waits
/// until it accepts connections.
pub fn start_nats(bin: &Path, dir: &TestDir, config: &str) -> OwnServer {
    let port = super::ports::free_port();
    let conf = dir.write("nats.conf", format!("listen: \"127.0.0.1:{port}\"\n{config}\n"));
    let log = dir.join("nats.log");
    let mut child = Command::new(bin)
        .arg("-c")
        .arg(&conf)
        .arg("-l")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    wait_for_port(port, &mut child, "the test's nats-server", &log);
    OwnServer { child, port }
}

/// The `etcd` binary, or `None` after printing why `test` is skipped.
pub fn etcd_binary(test: &str) -> Option<PathBuf> {
    binary("SELKIE_ETCD_BIN", "etcd", test, "etcd-server")
}

/// Starts `bin` on free loopback ports, serving clients over `scheme`
/// (`http` or `https`) with the extra flags `args` (TLS files), and waits
/// until it serves client requests. Returns the server and its
/// client endpoint.
pub fn start_etcd(bin: &Path, dir: &TestDir, scheme: &str, args: &[&str]) -> (OwnServer, String) {
    let port = super::ports::free_port();
    let peer_port = super::ports::free_port();
    let client = format!("{scheme}://127.0.0.1:{port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let log = dir.join("etcd.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(bin)
        .args(["--name", "selkie-secured", "--data-dir"])
        .arg(dir.join("etcd-data"))
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("selkie-secured={peer}")])
        .args(args)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    wait_for_port(port, &mut child, "the test's etcd", &log);
    // etcd opens its client port before it has a leader; a request then is
    // reset. It says when it serves.
    let start = Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("ready to serve client requests")
    {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the test's etcd exited ({status}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the test's etcd does not serve client requests: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    (OwnServer { child, port }, client)
}
