//! TLS on the TCP transport when the other side should not be trusted:
//! the wrong authority, the wrong name, an expired certificate, a client
//! certificate required and missing, cleartext to a TLS listener, and
//! files that cannot be used. Each connection ends with a reason that says
//! what failed, and nothing is delivered over it.

use std::time::{Duration, Instant};

use efabus_core::transport::{CloseReason, Endpoint, EndpointConfig, Event, PeerId, Transport};
use efabus_transports::conformance::numbered;
use efabus_transports::conformance::pki::{self, Authority, Pki};
use efabus_transports::tcp::TcpTransport;

const DEADLINE: Duration = Duration::from_secs(10);

fn open(bind: bool, options: &[(&str, &str)]) -> Box<dyn Endpoint> {
    try_open(bind, options).expect("endpoint opens")
}

fn try_open(
    bind: bool,
    options: &[(&str, &str)],
) -> Result<Box<dyn Endpoint>, efabus_core::transport::TransportError> {
    TcpTransport.open(&EndpointConfig {
        bind: bind.then(|| "127.0.0.1:0".to_string()),
        options: options
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect(),
        ..EndpointConfig::default()
    })
}

fn server_options(pki: &Pki) -> Vec<(&str, &str)> {
    vec![
        ("tls_cert", pki.server_cert.as_str()),
        ("tls_key", pki.server_key.as_str()),
    ]
}

/// Connects `client` to `server`, sends a frame each way as soon as it
/// can, and returns how each side's connection ended (`None` if it did
/// not within the deadline) and the frames each received.
fn attempt(
    server: &mut dyn Endpoint,
    client: &mut dyn Endpoint,
) -> (Option<CloseReason>, Option<CloseReason>, usize, usize) {
    let address = String::from_utf8_lossy(&server.local_addr()).into_owned();
    let to_server = client.connect(&address).expect("connect starts");
    let _ = client.send(to_server, numbered(1, 0, 100));
    let mut at_server: Option<PeerId> = None;
    let (mut server_closed, mut client_closed) = (None, None);
    let (mut server_frames, mut client_frames) = (0, 0);
    let deadline = Instant::now() + DEADLINE;
    let mut events = Vec::new();
    while Instant::now() < deadline && (server_closed.is_none() || client_closed.is_none()) {
        server.poll(&mut events).expect("server polls");
        for event in events.drain(..) {
            match event {
                Event::Accepted { peer, .. } => {
                    at_server = Some(peer);
                    let _ = server.send(peer, numbered(2, 0, 100));
                }
                Event::Frame { .. } => server_frames += 1,
                Event::Frames { .. } => panic!("runs were not asked for"),
                Event::Closed { reason, .. } => server_closed = Some(reason),
                Event::Writable { .. } | Event::ReadHeld { .. } => {}
            }
        }
        client.poll(&mut events).expect("client polls");
        for event in events.drain(..) {
            match event {
                Event::Frame { .. } => client_frames += 1,
                Event::Closed { reason, .. } => client_closed = Some(reason),
                _ => {}
            }
        }
        // A side that got through closes once it heard from the other, so
        // a handshake that works ends too.
        if client_frames > 0 && server_frames > 0 {
            if let Some(peer) = at_server {
                server.close(peer);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    (server_closed, client_closed, server_frames, client_frames)
}

fn error_text(reason: &Option<CloseReason>) -> String {
    match reason {
        Some(CloseReason::Error(text)) => text.clone(),
        other => format!("{other:?}"),
    }
}

#[test]
fn the_right_authority_and_name_connect() {
    let pki = pki::shared();
    let mut server = open(true, &server_options(pki));
    let mut client = open(false, &[("tls_ca", pki.ca.as_str())]);
    let (_, _, server_frames, client_frames) = attempt(server.as_mut(), client.as_mut());
    assert_eq!((server_frames, client_frames), (1, 1));
}

#[test]
fn a_server_from_another_authority_is_refused() {
    let pki = pki::shared();
    let other = Pki::new("other-ca");
    let mut server = open(true, &server_options(pki));
    let mut client = open(false, &[("tls_ca", other.ca.as_str())]);
    let (server_closed, client_closed, server_frames, client_frames) =
        attempt(server.as_mut(), client.as_mut());
    let text = error_text(&client_closed);
    assert!(
        text.contains("TLS") && text.contains("UnknownIssuer"),
        "{text}"
    );
    assert!(server_closed.is_some(), "the server hears of it");
    assert_eq!((server_frames, client_frames), (0, 0));
}

#[test]
fn a_server_certificate_for_another_name_is_refused() {
    let pki = pki::shared();
    let mut server = open(true, &server_options(pki));
    let mut client = open(
        false,
        &[
            ("tls_ca", pki.ca.as_str()),
            ("tls_server_name", "broker.example.org"),
        ],
    );
    let (_, client_closed, server_frames, client_frames) =
        attempt(server.as_mut(), client.as_mut());
    let text = error_text(&client_closed);
    assert!(text.contains("not valid for name"), "{text}");
    assert_eq!((server_frames, client_frames), (0, 0));
}

#[test]
fn an_expired_server_certificate_is_refused() {
    let pki = pki::shared();
    let dir = pki.dir.join("expired");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = pki
        .authority
        .issue(&dir, "expired", "server", &["127.0.0.1"], true);
    let mut server = open(true, &[("tls_cert", &cert), ("tls_key", &key)]);
    let mut client = open(false, &[("tls_ca", pki.ca.as_str())]);
    let (_, client_closed, server_frames, client_frames) =
        attempt(server.as_mut(), client.as_mut());
    let text = error_text(&client_closed);
    assert!(text.contains("expired"), "{text}");
    assert_eq!((server_frames, client_frames), (0, 0));
}

#[test]
fn mutual_tls_refuses_a_client_without_a_certificate_and_takes_one_with() {
    let pki = pki::shared();
    let mut options = server_options(pki);
    options.push(("tls_ca", pki.ca.as_str()));
    options.push(("tls_verify_clients", "true"));
    let mut server = open(true, &options);
    let mut anonymous = open(false, &[("tls_ca", pki.ca.as_str())]);
    let (server_closed, _, server_frames, client_frames) =
        attempt(server.as_mut(), anonymous.as_mut());
    let text = error_text(&server_closed);
    assert!(
        text.contains("TLS") && text.contains("certificate"),
        "{text}"
    );
    assert_eq!((server_frames, client_frames), (0, 0));

    // A client certificate from another authority is refused too.
    let stranger_dir = pki.dir.join("stranger");
    std::fs::create_dir_all(&stranger_dir).unwrap();
    let stranger = Authority::new(&stranger_dir, "stranger-ca");
    let (cert, key) = stranger.issue(&stranger_dir, "client", "client", &["client.local"], false);
    let mut impostor = open(
        false,
        &[
            ("tls_ca", pki.ca.as_str()),
            ("tls_cert", &cert),
            ("tls_key", &key),
        ],
    );
    let (server_closed, _, server_frames, _) = attempt(server.as_mut(), impostor.as_mut());
    assert!(error_text(&server_closed).contains("UnknownIssuer"));
    assert_eq!(server_frames, 0);

    let mut known = open(
        false,
        &[
            ("tls_ca", pki.ca.as_str()),
            ("tls_cert", pki.client_cert.as_str()),
            ("tls_key", pki.client_key.as_str()),
        ],
    );
    let (_, _, server_frames, client_frames) = attempt(server.as_mut(), known.as_mut());
    assert_eq!((server_frames, client_frames), (1, 1));
}

#[test]
fn cleartext_to_a_tls_listener_is_refused() {
    let pki = pki::shared();
    let mut server = open(true, &server_options(pki));
    let mut client = open(false, &[]);
    let (server_closed, client_closed, server_frames, client_frames) =
        attempt(server.as_mut(), client.as_mut());
    let server_text = error_text(&server_closed);
    assert!(server_text.contains("does not speak TLS"), "{server_text}");
    let client_text = error_text(&client_closed);
    assert!(client_text.contains("speaks TLS"), "{client_text}");
    assert_eq!((server_frames, client_frames), (0, 0));
}

#[test]
fn unusable_tls_files_fail_the_open_with_the_reason() {
    let pki = pki::shared();
    let missing = pki.dir.join("missing.pem");
    let missing = missing.to_str().unwrap();
    let err = try_open(true, &[("tls_cert", missing), ("tls_key", &pki.server_key)])
        .err()
        .expect("a missing certificate fails");
    assert!(err.to_string().contains("missing.pem"), "{err}");
    let err = try_open(true, &[("tls_cert", &pki.server_cert)])
        .err()
        .expect("a certificate without its key fails");
    assert!(err.to_string().contains("tls_key"), "{err}");
    // A key that is not the certificate's.
    let err = try_open(
        true,
        &[("tls_cert", &pki.server_cert), ("tls_key", &pki.client_key)],
    )
    .err()
    .expect("a mismatched key fails");
    assert!(err.to_string().contains("tls"), "{err}");
    let err = try_open(true, &[("tls_ca", &pki.ca)])
        .err()
        .expect("a listener with only a CA fails");
    assert!(err.to_string().contains("tls_cert"), "{err}");
    let err = try_open(false, &[("tls_ca", &pki.server_key)])
        .err()
        .expect("a key is not a CA");
    assert!(err.to_string().contains("no PEM certificate"), "{err}");
}

#[test]
fn a_tls_endpoint_without_an_authority_does_not_dial_in_cleartext() {
    let pki = pki::shared();
    let mut listener = open(true, &server_options(pki));
    let mut other = open(true, &server_options(pki));
    let address = String::from_utf8_lossy(&other.local_addr()).into_owned();
    let err = listener
        .connect(&address)
        .expect_err("no cleartext dial from a TLS endpoint");
    assert!(
        err.to_string().contains("does not dial in cleartext"),
        "{err}"
    );
    other.poll(&mut Vec::new()).expect("poll");
}
