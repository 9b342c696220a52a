//! The shared secret is proven, never sent: a client or a dialing broker
//! answers the acceptor's challenge with a keyed hash, and goes on only
//! when the acceptor proves the secret back. Checked against a stand-in
//! acceptor that reads what arrives byte for byte, and against brokers.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use efabus_broker::{Broker, Client, ClientOptions, Config, Error};
use efabus_core::codec::{self, CodecLimits, FrameReader};
use efabus_core::frame::{Challenge, ErrorCode, Frame, Hello, Welcome, PROTOCOL_VERSION};
use efabus_core::secret::{prove, ProofRole};
use efabus_transports::registry::Registry;

const WAIT: Duration = Duration::from_secs(10);
const SECRET: &str = "a-shared-secret-9d41";

/// An acceptor by hand: sends a challenge, reads the hello (and every
/// byte of it), answers with a welcome whose proof `answer` makes.
struct StandIn {
    listener: TcpListener,
}

impl StandIn {
    fn new() -> StandIn {
        StandIn {
            listener: TcpListener::bind("127.0.0.1:0").unwrap(),
        }
    }

    fn endpoint(&self) -> String {
        format!("tcp/{}", self.listener.local_addr().unwrap())
    }

    /// Serves one connection; returns the raw bytes received and the hello.
    fn serve(&self, answer: impl Fn(&Hello, &[u8; 32]) -> Option<[u8; 32]>) -> (Vec<u8>, Hello) {
        let (mut stream, _) = self.listener.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let challenge = [7u8; 32];
        let frame = Frame::Challenge(Challenge { nonce: challenge });
        stream.write_all(&codec::encode(&frame).to_bytes()).unwrap();
        let mut raw = Vec::new();
        let mut reader = FrameReader::new(CodecLimits::default());
        let deadline = Instant::now() + WAIT;
        let hello = loop {
            assert!(Instant::now() < deadline, "no hello");
            if let Some(bytes) = reader.next_frame().unwrap() {
                if let Frame::Hello(hello) = codec::decode(bytes, &CodecLimits::default()).unwrap()
                {
                    break hello;
                }
                continue;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk) {
                Ok(0) => panic!("closed before its hello"),
                Ok(n) => {
                    raw.extend_from_slice(&chunk[..n]);
                    reader.read_from(&mut &chunk[..n]).unwrap();
                }
                Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(err) => panic!("{err}"),
            }
        };
        let welcome = Frame::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            name: "stand-in".into(),
            offers: Vec::new(),
            max_payload: 1 << 20,
            link_auth: None,
            max_subject_len: 512,
            max_subject_tokens: 32,
            proof: answer(&hello, &challenge),
        });
        let _ = stream.write_all(&codec::encode(&welcome).to_bytes());
        // Whatever else comes (a route hello) is read too.
        let until = Instant::now() + Duration::from_millis(300);
        let mut chunk = [0u8; 4096];
        while Instant::now() < until {
            match stream.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => raw.extend_from_slice(&chunk[..n]),
                Err(_) => {}
            }
        }
        (raw, hello)
    }
}

impl StandIn {
    /// Serves one connection with a welcome at once, no challenge: what a
    /// peer that cannot prove the secret might try.
    fn welcome_first(&self) {
        let (mut stream, _) = self.listener.accept().unwrap();
        let welcome = Frame::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            name: "impostor".into(),
            offers: Vec::new(),
            max_payload: 1 << 20,
            link_auth: None,
            max_subject_len: 512,
            max_subject_tokens: 32,
            proof: None,
        });
        let _ = stream.write_all(&codec::encode(&welcome).to_bytes());
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut sink = [0u8; 4096];
        while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle.as_bytes())
}

fn client(server: &str) -> Result<Client, Error> {
    let options = ClientOptions {
        credentials: Some(SECRET.to_string()),
        connect_timeout: WAIT,
        reconnect: false,
        ..ClientOptions::default()
    };
    Client::connect_with(server, options, Registry::with_builtins())
}

fn honest(hello: &Hello, challenge: &[u8; 32]) -> Option<[u8; 32]> {
    let proof = hello.proof.as_ref()?;
    Some(prove(SECRET, ProofRole::Acceptor, challenge, &proof.nonce))
}

#[test]
fn a_client_proves_the_secret_without_sending_it_and_checks_the_server() {
    let stand_in = StandIn::new();
    let server = stand_in.endpoint();
    let connecting = std::thread::spawn(move || client(&server).map(|_| ()));
    let (raw, hello) = stand_in.serve(honest);
    assert!(!contains(&raw, SECRET), "the secret crossed the wire");
    assert_eq!(hello.credentials, None);
    let proof = hello.proof.expect("a proof");
    assert_eq!(
        proof.mac,
        prove(SECRET, ProofRole::Dialer, &[7u8; 32], &proof.nonce)
    );
    connecting
        .join()
        .unwrap()
        .expect("connected to a server that proved the secret");

    // A welcome before any challenge answers no hello: refused.
    let server = stand_in.endpoint();
    let connecting = std::thread::spawn(move || client(&server).map(|_| ()));
    stand_in.welcome_first();
    match connecting.join().unwrap() {
        Err(Error::Refused { code, text }) => {
            assert_eq!(code, ErrorCode::Auth);
            assert!(text.contains("never got"), "{text}");
        }
        other => panic!("{:?}", other.map(|_| "connected")),
    }

    // A server that cannot prove it is refused.
    let server = stand_in.endpoint();
    let connecting = std::thread::spawn(move || client(&server).map(|_| ()));
    stand_in.serve(|_, _| Some([0; 32]));
    match connecting.join().unwrap() {
        Err(Error::Refused { code, text }) => {
            assert_eq!(code, ErrorCode::Auth);
            assert!(text.contains("did not prove"), "{text}");
        }
        other => panic!("{:?}", other.map(|_| "connected")),
    }
}

#[test]
fn a_dialing_broker_proves_the_route_secret_and_checks_the_peer() {
    let stand_in = StandIn::new();
    let text = format!(
        "name = \"dialer\"\nlisten = [\"tcp/127.0.0.1:0\"]\npeers = [\"{}\"]\n\
         [cluster]\nsecret = \"{SECRET}\"\n",
        stand_in.endpoint()
    );
    let broker = Broker::start(Config::from_toml_str(&text, "proof test").unwrap()).unwrap();
    // The stand-in proves nothing back: the dialer refuses the route.
    let (raw, hello) = stand_in.serve(|_, _| None);
    assert!(!contains(&raw, SECRET), "the route secret crossed the wire");
    assert!(hello.credentials.is_none() && hello.proof.is_some());
    let deadline = Instant::now() + WAIT;
    while broker.stats().value("route_refusals") == Some(0) {
        assert!(Instant::now() < deadline, "the route was not refused");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(broker.routes().is_empty());

    // Nor does a welcome that answers no hello open one.
    let refused = broker.stats().value("route_refusals");
    stand_in.welcome_first();
    let deadline = Instant::now() + WAIT;
    while broker.stats().value("route_refusals") == refused {
        assert!(
            Instant::now() < deadline,
            "the early welcome was not refused"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(broker.routes().is_empty());
}

#[test]
fn brokers_prove_the_secret_to_each_other_and_a_wrong_one_is_refused() {
    let seed = Broker::start(
        Config::from_toml_str(
            &format!("name = \"seed\"\nlisten = [\"tcp/127.0.0.1:0\"]\n[cluster]\nsecret = \"{SECRET}\"\n[auth]\nsecret = \"clients\"\n"),
            "t",
        )
        .unwrap(),
    )
    .unwrap();
    let endpoint = seed.endpoint("tcp").unwrap();
    let joiner = Broker::start(
        Config::from_toml_str(
            &format!("name = \"joiner\"\nlisten = [\"tcp/127.0.0.1:0\"]\npeers = [\"{endpoint}\"]\n[cluster]\nsecret = \"{SECRET}\"\n"),
            "t",
        )
        .unwrap(),
    )
    .unwrap();
    let deadline = Instant::now() + WAIT;
    while seed.routes().is_empty() || joiner.routes().is_empty() {
        assert!(Instant::now() < deadline, "no route");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A client proving the clients' secret connects; a wrong one does not.
    let options = |secret: &str| ClientOptions {
        credentials: Some(secret.to_string()),
        connect_timeout: WAIT,
        reconnect: false,
        ..ClientOptions::default()
    };
    Client::connect_with(&endpoint, options("clients"), Registry::with_builtins())
        .expect("the clients' secret");
    match Client::connect_with(&endpoint, options("guess"), Registry::with_builtins()) {
        Err(Error::Refused {
            code: ErrorCode::Auth,
            ..
        }) => {}
        other => panic!("{:?}", other.map(|_| "connected")),
    }
    // Held a plain TCP stream open: nothing but the challenge arrives
    // until the peer speaks.
    let mut stream = TcpStream::connect(endpoint.trim_start_matches("tcp/")).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut first = vec![0u8; 64];
    let n = stream.read(&mut first).unwrap();
    let frame = codec::decode(
        bytes::Bytes::copy_from_slice(&first[..n]),
        &CodecLimits::default(),
    )
    .unwrap();
    assert!(matches!(frame, Frame::Challenge(_)), "{frame:?}");
}
