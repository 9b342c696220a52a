//! One fabric hop, no broker: two efabus RDM endpoints in one process, each
//! driven by its own thread, send frames back and forth, as `fi_pingpong`
//! does between two processes. It measures what the fabric transport costs
//! per hop on its own, beside `fi_pingpong`'s figure for the same provider.
//!
//! ```text
//! cargo run --release --example fabric_pingpong -- [PROVIDER] [SIZE] [ITERATIONS] [ECHO]
//! ```
//!
//! Defaults: `tcp;ofi_rxm`, 64 bytes, 5000 round trips, `own`. Prints one
//! JSON line: `usec_per_xfer` is half a round trip and `mb_per_sec` is SIZE
//! over it, as `fi_pingpong` reports them. Exits 2 on bad arguments or when
//! the provider cannot open an endpoint here, 1 when a frame arrives
//! altered. Both endpoints poll without sleeping (as `fi_pingpong` does by
//! default), and each checks the length and a few bytes of what it gets.
//!
//! ECHO says what the answering side sends back:
//! - `own`: a frame of its own, the same every time, as `fi_pingpong`'s
//!   server answers from its own buffer: the same work per hop.
//! - `forward`: the frame it received, as a broker forwards one. A large
//!   one is then read from memory the answering side's core has just
//!   written, which costs the reading core more than memory no core holds
//!   (a 1 MiB `process_vm_readv` here: 114 against 93 us, means of 300).
//!
//! The endpoints are opened and linked as a broker's are: the default eager
//! buffers, and frames above them by rendezvous where the provider has RMA
//! reads (`"rendezvous":true` in the output; over `shm`, frames of 1 MiB
//! land in huge pages); without (ofi_rxd), eager buffers that hold the
//! frame.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efabus_core::transport::{
    Endpoint, EndpointConfig, Event, FabricOptions, LinkKeys, OutFrame, PeerId, Transport,
};
use efabus_transports::fabric::FabricTransport;

/// Buffers each endpoint posts for receives, and sends it may have in
/// flight.
const DEPTH: usize = 16;
/// Untimed round trips first: they set up the provider's connection and
/// touch every buffer once (a buffer's first use faults its pages in).
const WARMUP_ROUNDS: usize = 2 * DEPTH;

/// Longest a run may take before it is called stuck.
const DEADLINE: Duration = Duration::from_secs(60);

/// Why a run failed: the endpoint could not open here (exit 2), or the
/// run itself went wrong (exit 1).
enum Failure {
    Unavailable(String),
    Run(String),
}

impl From<String> for Failure {
    fn from(text: String) -> Failure {
        Failure::Run(text)
    }
}

fn open(provider: &str, size: usize) -> Result<Box<dyn Endpoint>, Failure> {
    let endpoint = open_with(provider, size, None)?;
    if endpoint.rendezvous_max() == 0 && size + 4 > endpoint.max_frame() {
        // No rendezvous here (ofi_rxd): eager buffers that hold the frame.
        return open_with(provider, size, Some(size + 4096));
    }
    Ok(endpoint)
}

fn open_with(
    provider: &str,
    size: usize,
    msg_size: Option<usize>,
) -> Result<Box<dyn Endpoint>, Failure> {
    // `shm` has a transport of its own (same-host names, no bind address).
    let transport = if provider == "shm" {
        FabricTransport::shm()
    } else {
        FabricTransport::rdm()
    };
    transport
        .open(&EndpointConfig {
            bind: Some("127.0.0.1".into()),
            // Room for the frame and the endpoint's own header, eagerly or
            // by rendezvous; a few buffers each way are all a ping-pong
            // needs.
            max_frame: size + 4096,
            fabric: Some(FabricOptions {
                provider: provider.into(),
                msg_size,
                rx_depth: DEPTH,
                tx_depth: DEPTH,
                // As a broker's: over shm, large frames land in huge pages.
                huge_landing: true,
                ..FabricOptions::default()
            }),
            ..EndpointConfig::default()
        })
        .map_err(|err| {
            Failure::Unavailable(format!(
                "cannot open an RDM endpoint on {provider:?}: {err}"
            ))
        })
}

/// A frame of `size` payload bytes: a small head with the length prefix,
/// the payload behind it, as the broker's links send payloads.
fn frame(size: usize) -> Result<OutFrame, String> {
    let declared = u32::try_from(size).map_err(|_| format!("size {size} is over 4 GiB"))?;
    let mut head = declared.to_le_bytes().to_vec();
    let payload = (0..size).map(payload_byte).collect::<Vec<u8>>();
    let cut = size.min(16);
    head.extend_from_slice(&payload[..cut]);
    Ok(OutFrame {
        head: head.into(),
        body: Bytes::from(payload).slice(cut..),
    })
}

/// The payload's byte at `index`: varied, so that bytes from the wrong
/// place show.
fn payload_byte(index: usize) -> u8 {
    (index % 251) as u8
}

/// A received frame as a broker forwards it: the head with the length
/// prefix, and the rest shared behind it.
fn forward(frame: &Bytes) -> OutFrame {
    let cut = frame.len().min(20);
    OutFrame {
        head: frame.slice(..cut),
        body: frame.slice(cut..),
    }
}

/// Whether `frame` is the frame of `size` payload bytes sent, judged by its
/// length and the payload's first, middle and last bytes.
fn intact(frame: &[u8], size: usize) -> bool {
    frame.len() == size + 4
        && [0, size / 2, size - 1]
            .iter()
            .all(|&i| frame[4 + i] == payload_byte(i))
}

/// Sends `frame` to `peer`, polling while the endpoint pushes back.
fn send(
    endpoint: &mut dyn Endpoint,
    peer: PeerId,
    frame: &OutFrame,
    events: &mut Vec<Event>,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        match endpoint.send(peer, frame.clone()) {
            Ok(()) => return Ok(()),
            Err(efabus_core::transport::SendError::WouldBlock(_)) => {
                endpoint.poll(events).map_err(|e| e.to_string())?;
                if started.elapsed() > DEADLINE {
                    return Err("a send stayed refused".into());
                }
            }
            Err(err) => return Err(err.to_string()),
        }
    }
}

/// Polls until a frame arrives; returns its sender and the frame.
fn next_frame(
    endpoint: &mut dyn Endpoint,
    events: &mut Vec<Event>,
) -> Result<(PeerId, Bytes), String> {
    let started = Instant::now();
    let mut polls = 0u32;
    loop {
        endpoint.poll(events).map_err(|e| e.to_string())?;
        polls = polls.wrapping_add(1);
        let mut received = None;
        for event in events.drain(..) {
            match event {
                Event::Frame { peer, frame } if received.is_none() => {
                    received = Some((peer, frame))
                }
                Event::Frame { .. } => return Err("more frames than were sent".into()),
                Event::Closed { reason, .. } => return Err(format!("link closed: {reason}")),
                _ => {}
            }
        }
        if let Some(received) = received {
            return Ok(received);
        }
        // The clock is read now and then: on every poll it took a tenth
        // of a small round trip.
        if polls % 1024 == 0 && started.elapsed() > DEADLINE {
            return Err("no answer".into());
        }
    }
}

/// What the answering side sends back (see the module docs).
#[derive(Clone, Copy)]
enum Echo {
    Own,
    Forward,
}

impl Echo {
    fn parse(text: &str) -> Result<Echo, String> {
        match text {
            "own" => Ok(Echo::Own),
            "forward" => Ok(Echo::Forward),
            other => Err(format!("ECHO must be own or forward, not {other:?}")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Echo::Own => "own",
            Echo::Forward => "forward",
        }
    }
}

fn run(provider: &str, size: usize, iterations: usize, echo: Echo) -> Result<(), Failure> {
    let out = frame(size)?;
    let answer = frame(size)?;
    let mut pinger = open(provider, size)?;
    let mut ponger = open(provider, size)?;
    // Every fabric message is authenticated; a session layer agrees the
    // keys over its control link, here both ends are in one process. Keys
    // serve one link only, so each run draws its own.
    let mut keys = [[0u8; 32]; 2];
    for key in &mut keys {
        getrandom::fill(key).map_err(|e| format!("no random link keys: {e}"))?;
    }
    let pinger_keys = LinkKeys {
        send_key: keys[0],
        receive_key: keys[1],
        local_id: 1,
        remote_id: 2,
    };
    let ponger_keys = LinkKeys {
        send_key: pinger_keys.receive_key,
        receive_key: pinger_keys.send_key,
        local_id: 2,
        remote_id: 1,
    };
    let ponger_peer = pinger
        .insert_peer(&ponger.local_addr(), &pinger_keys)
        .map_err(|e| e.to_string())?;
    let pinger_peer = ponger
        .insert_peer(&pinger.local_addr(), &ponger_keys)
        .map_err(|e| e.to_string())?;
    // The limits a session negotiates between two such endpoints.
    let rendezvous = pinger.rendezvous_max() > 0;
    for (endpoint, peer) in [(&mut pinger, ponger_peer), (&mut ponger, pinger_peer)] {
        let eager = endpoint.max_frame();
        endpoint.set_peer_frame_limit(peer, eager);
        endpoint.set_peer_rendezvous(peer, endpoint.rendezvous_max());
    }
    if size + 4 > pinger.max_frame().max(pinger.rendezvous_max()) {
        return Err(Failure::Run(format!(
            "a frame of {size} bytes fits neither an eager buffer nor rendezvous on {provider:?}"
        )));
    }
    let finished = Arc::new(AtomicBool::new(false));
    let echo_finished = finished.clone();
    let echo_thread = std::thread::spawn(move || -> Result<usize, String> {
        let mut events = Vec::new();
        let mut altered = 0;
        for _ in 0..WARMUP_ROUNDS + iterations {
            let (from, frame) = next_frame(ponger.as_mut(), &mut events)?;
            if !intact(&frame, size) {
                altered += 1;
            }
            match echo {
                Echo::Forward => send(ponger.as_mut(), from, &forward(&frame), &mut events)?,
                Echo::Own => {
                    // Given back to the endpoint before answering, as
                    // fi_pingpong reposts its receive buffer.
                    drop(frame);
                    send(ponger.as_mut(), from, &answer, &mut events)?
                }
            }
        }
        // A send is posted by the endpoint's next poll: keep polling until
        // the last answer has arrived.
        while !echo_finished.load(Ordering::Acquire) {
            ponger.poll(&mut events).map_err(|e| e.to_string())?;
        }
        Ok(altered)
    });
    let mut events = Vec::new();
    for _ in 0..WARMUP_ROUNDS {
        send(pinger.as_mut(), ponger_peer, &out, &mut events)?;
        next_frame(pinger.as_mut(), &mut events)?;
    }
    let mut altered = 0;
    let started = Instant::now();
    for _ in 0..iterations {
        send(pinger.as_mut(), ponger_peer, &out, &mut events)?;
        let (_, frame) = next_frame(pinger.as_mut(), &mut events)?;
        if !intact(&frame, size) {
            altered += 1;
        }
    }
    let elapsed = started.elapsed();
    finished.store(true, Ordering::Release);
    altered += echo_thread
        .join()
        .map_err(|_| "the echo thread panicked".to_string())??;
    if altered > 0 {
        return Err(Failure::Run(format!("{altered} frames arrived altered")));
    }
    let usec_per_xfer = elapsed.as_secs_f64() * 1e6 / (iterations as f64 * 2.0);
    println!(
        "{{\"provider\":\"{provider}\",\"size\":{size},\"iterations\":{iterations},\
         \"rendezvous\":{rendezvous},\"echo\":\"{}\",\"usec_per_xfer\":{usec_per_xfer:.2},\
         \"mb_per_sec\":{:.1}}}",
        echo.name(),
        size as f64 / usec_per_xfer
    );
    Ok(())
}

fn main() -> ExitCode {
    // First, while this is the only thread: libfabric's own buffer counts.
    efabus::transports::fabric::apply_provider_env_defaults();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let provider = args.first().map_or("tcp;ofi_rxm", String::as_str);
    let number = |index: usize, default: usize, what: &str| -> Result<usize, String> {
        match args.get(index) {
            None => Ok(default),
            Some(text) => text
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{what} must be a positive integer, not {text:?}")),
        }
    };
    let parsed = number(1, 64, "SIZE").and_then(|size| {
        let iterations = number(2, 5000, "ITERATIONS")?;
        let echo = args
            .get(3)
            .map_or(Ok(Echo::Own), |text| Echo::parse(text))?;
        Ok((size, iterations, echo))
    });
    let (size, iterations, echo) = match parsed {
        Ok(values) => values,
        Err(err) => {
            eprintln!(
                "fabric_pingpong: {err}; usage: fabric_pingpong [PROVIDER] [SIZE] [ITERATIONS] [own|forward]"
            );
            return ExitCode::from(2);
        }
    };
    match run(provider, size, iterations, echo) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Unavailable(reason)) => {
            eprintln!("fabric_pingpong: {reason}");
            ExitCode::from(2)
        }
        Err(Failure::Run(reason)) => {
            eprintln!("fabric_pingpong: {reason}");
            ExitCode::FAILURE
        }
    }
}
