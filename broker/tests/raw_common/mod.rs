//! A peer speaking raw efabus frames to a broker over TCP, for tests that
//! must write what a `Client` never would.

#![allow(dead_code)]

use std::io::{ErrorKind, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use efabus_broker::Broker;
use efabus_core::codec::{self, CodecLimits, FrameReader};
use efabus_core::frame::{
    DeliveryClass, ErrorFrame, Frame, Hello, Message, RouteLimits, Subscribe, PROTOCOL_VERSION,
};

/// Longest any wait here takes.
pub const WAIT: Duration = Duration::from_secs(10);

/// The hello of a plain client named `name`: no credentials, no data
/// paths offered.
pub fn client_hello(name: &str) -> Frame {
    Frame::Hello(Hello {
        no_echo: false,
        no_responders: false,
        version: PROTOCOL_VERSION,
        name: name.to_string(),
        credentials: None,
        user: None,
        proof: None,
        offers: Vec::new(),
        link_auth: None,
    })
}

/// The limits a broker with the default config takes from routes.
pub fn default_route_limits() -> RouteLimits {
    RouteLimits {
        max_payload: 1 << 20,
        max_subject_len: 512,
        max_subject_tokens: 32,
    }
}

/// A plain (reliable, no queue group) subscription to `pattern` as `sid`.
pub fn subscribe(sid: u64, pattern: &str) -> Frame {
    Frame::Subscribe(Subscribe {
        sid,
        pattern: pattern.to_string(),
        queue: None,
        class: DeliveryClass::Reliable,
    })
}

/// A peer speaking raw frames over TCP.
pub struct Raw {
    stream: TcpStream,
    reader: FrameReader,
    /// The broker's challenge, its first frame (kept out of the frames
    /// the tests read: a raw peer gives its secret in clear instead).
    pub challenge: Option<[u8; 32]>,
}

impl Raw {
    pub fn connect(broker: &Broker) -> Raw {
        let address = broker
            .endpoint("tcp")
            .expect("listens on tcp")
            .trim_start_matches("tcp/")
            .to_string();
        Raw::accepted(TcpStream::connect(address).expect("connects"))
    }

    /// A peer on `stream`: one to a broker, or one a broker made to the
    /// test (as a route's dial).
    pub fn accepted(stream: TcpStream) -> Raw {
        Raw {
            stream,
            reader: FrameReader::new(CodecLimits::default()),
            challenge: None,
        }
    }

    /// Say hello as a plain client named `name` and wait for the welcome.
    pub fn hello_as_client(&mut self, name: &str) {
        self.send(&client_hello(name));
        self.expect("the welcome", |frame| matches!(frame, Frame::Welcome(_)));
    }

    /// Another handle on the connection, to write from another thread.
    pub fn stream(&self) -> TcpStream {
        self.stream.try_clone().expect("the stream is cloned")
    }

    pub fn send(&mut self, frame: &Frame) {
        self.stream
            .write_all(&codec::encode(frame).to_bytes())
            .expect("write");
    }

    /// The next frame within `timeout`; `None` on end of stream or timeout.
    pub fn next_frame(&mut self, timeout: Duration) -> Option<Frame> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(bytes) = self.reader.next_frame().expect("well-formed stream") {
                match codec::decode(bytes, &CodecLimits::default()).expect("decodes") {
                    Frame::Challenge(challenge) => self.challenge = Some(challenge.nonce),
                    frame => return Some(frame),
                }
                continue;
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            self.stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match self.reader.read_from(&mut self.stream) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return None,
            }
        }
    }

    /// Every frame until the broker closes the connection (bounded by
    /// [`WAIT`]).
    pub fn until_closed(&mut self) -> Vec<Frame> {
        let deadline = Instant::now() + WAIT;
        let mut frames = Vec::new();
        while let Some(frame) = self.next_frame(deadline.saturating_duration_since(Instant::now()))
        {
            frames.push(frame);
        }
        assert!(
            Instant::now() < deadline,
            "the broker did not close: {frames:?}"
        );
        frames
    }

    /// Frames for `quiet` (the connection stays open).
    pub fn frames_for(&mut self, quiet: Duration) -> Vec<Frame> {
        let deadline = Instant::now() + quiet;
        let mut frames = Vec::new();
        while let Some(frame) = self.next_frame(deadline.saturating_duration_since(Instant::now()))
        {
            frames.push(frame);
        }
        frames
    }

    /// The first frame matching `wanted` within [`WAIT`], others skipped.
    pub fn expect(&mut self, what: &str, wanted: impl Fn(&Frame) -> bool) -> Frame {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_frame(left) {
                Some(frame) if wanted(&frame) => return frame,
                Some(_) => {}
                None => panic!("no {what} within {WAIT:?}"),
            }
        }
    }

    /// Subscribes as `sid` to `pattern` in queue group `queue`, ending
    /// once `total` messages are delivered, and waits until the broker
    /// has taken both.
    pub fn queue_subscribe_limited(&mut self, sid: u64, pattern: &str, queue: &str, total: u64) {
        self.send(&Frame::Subscribe(Subscribe {
            sid,
            pattern: pattern.to_string(),
            queue: Some(queue.to_string()),
            class: DeliveryClass::Reliable,
        }));
        self.send(&Frame::UnsubscribeAfter { sid, total });
        self.messages_before_pong(sid);
    }

    /// The messages that arrive before the answer to a ping sent now:
    /// everything the broker routed to this peer before it took the ping.
    pub fn messages_before_pong(&mut self, nonce: u64) -> Vec<Message> {
        self.send(&Frame::Ping { nonce });
        let mut messages = Vec::new();
        loop {
            match self.next_frame(WAIT) {
                Some(Frame::Message(message)) => messages.push(message),
                Some(Frame::Pong { nonce: answered }) if answered == nonce => return messages,
                Some(_) => {}
                None => panic!("no answer to ping {nonce}"),
            }
        }
    }

    /// The first error frame within [`WAIT`], others skipped.
    pub fn expect_error(&mut self, what: &str) -> ErrorFrame {
        match self.expect(what, |frame| matches!(frame, Frame::Error(_))) {
            Frame::Error(error) => error,
            other => unreachable!("an error frame was asked for, not {other:?}"),
        }
    }
}

/// A TCP relay between clients and the broker that can drop its clients'
/// side of every connection while keeping the broker's side open, as a
/// lost network path leaves the broker with a session whose peer is gone.
pub struct CutRelay {
    address: std::net::SocketAddr,
    /// Each relayed connection's client side, and its broker side, which
    /// is kept open after a cut.
    pairs: std::sync::Arc<std::sync::Mutex<Vec<(std::net::TcpStream, std::net::TcpStream)>>>,
}

impl CutRelay {
    pub fn start(broker: &Broker) -> CutRelay {
        let target = broker
            .endpoint("tcp")
            .and_then(|spec| spec.strip_prefix("tcp/").map(str::to_string))
            .expect("tcp listener");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("relay listener");
        let address = listener.local_addr().expect("relay address");
        let pairs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = pairs.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(&target) else {
                    return;
                };
                let relay = |mut from: std::net::TcpStream, mut to: std::net::TcpStream| {
                    // Stops when either side fails, without closing the
                    // other: a cut leaves the broker's side open.
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                    });
                };
                relay(client.try_clone().unwrap(), server.try_clone().unwrap());
                relay(server.try_clone().unwrap(), client.try_clone().unwrap());
                kept.lock().unwrap().push((client, server));
            }
        });
        CutRelay { address, pairs }
    }

    pub fn endpoint(&self) -> String {
        format!("tcp/{}", self.address)
    }

    /// Close the clients' side of every connection so far.
    pub fn cut_clients(&self) {
        for (client, _) in self.pairs.lock().unwrap().iter() {
            let _ = client.shutdown(std::net::Shutdown::Both);
        }
    }
}
