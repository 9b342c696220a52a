//! TLS for the TCP transport, with rustls: what a TCP endpoint needs to
//! speak TLS on its connections ([`TlsContext`], built from the endpoint's
//! options) and the connection's byte stream with or without it
//! ([`Wire`]).
//!
//! Options (in [`EndpointConfig::options`]):
//!
//! - `tls_cert`, `tls_key`: PEM files of this side's certificate chain and
//!   private key. A listening endpoint with them accepts TLS only; an
//!   endpoint that connects presents them when the server asks for a
//!   client certificate.
//! - `tls_ca`: PEM file of the certificate authorities this side trusts:
//!   the servers it connects to must present a certificate they issued
//!   for the name dialed (or `tls_server_name`), and with
//!   `tls_verify_clients=true` so must every client of a listener.
//! - `tls_server_name`: the name to verify servers against instead of the
//!   host of the address dialed.
//!
//! An endpoint connects with TLS when it has `tls_ca`, and accepts with
//! TLS when it has `tls_cert` and `tls_key` and listens; there is no
//! cleartext fallback on either. [`TlsContext::reload`] reads the files
//! again (for new connections; those up keep their session).
//!
//! [`Wire`] is the connection's socket: reads and writes go through the
//! TLS session when there is one. The session is shared by the reading
//! side (the endpoint) and the sending side (the endpoint and direct
//! senders) behind one lock; ciphertext the socket did not take waits in
//! the session and goes first on the next write.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

use efabus_core::transport::{EndpointConfig, TransportError};
use mio::net::TcpStream;
use parking_lot::Mutex;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConnection;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig};

fn error(message: String) -> TransportError {
    TransportError::Tls(message)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn read_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, TransportError> {
    let certs = CertificateDer::pem_file_iter(Path::new(path))
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|err| error(format!("cannot read certificates from {path}: {err}")))?;
    if certs.is_empty() {
        return Err(error(format!("{path} holds no PEM certificate")));
    }
    Ok(certs)
}

fn read_key(path: &str) -> Result<PrivateKeyDer<'static>, TransportError> {
    PrivateKeyDer::from_pem_file(Path::new(path))
        .map_err(|err| error(format!("cannot read a private key from {path}: {err}")))
}

fn read_roots(path: &str) -> Result<Arc<RootCertStore>, TransportError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots
            .add(cert)
            .map_err(|err| error(format!("{path}: not a usable CA certificate: {err}")))?;
    }
    Ok(Arc::new(roots))
}

/// The TLS settings of an endpoint, from its options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TlsFiles {
    cert: Option<String>,
    key: Option<String>,
    ca: Option<String>,
    verify_clients: bool,
    server_name: Option<String>,
}

impl TlsFiles {
    fn from_config(config: &EndpointConfig) -> Result<TlsFiles, TransportError> {
        let text = |name: &str| config.option(name).map(str::to_string);
        let verify_clients = match config.option("tls_verify_clients") {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(error(format!(
                    "tls_verify_clients={other:?}: expected true or false"
                )))
            }
        };
        let files = TlsFiles {
            cert: text("tls_cert"),
            key: text("tls_key"),
            ca: text("tls_ca"),
            verify_clients,
            server_name: text("tls_server_name"),
        };
        if files.cert.is_some() != files.key.is_some() {
            return Err(error(
                "tls_cert and tls_key go together: give both or neither".to_string(),
            ));
        }
        if files.verify_clients && files.ca.is_none() {
            return Err(error(
                "tls_verify_clients needs tls_ca, the authority client certificates must come from"
                    .to_string(),
            ));
        }
        Ok(files)
    }

    fn server_config(&self) -> Result<Option<Arc<ServerConfig>>, TransportError> {
        let (Some(cert), Some(key)) = (&self.cert, &self.key) else {
            return Ok(None);
        };
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|err| error(err.to_string()))?;
        let builder = match (&self.ca, self.verify_clients) {
            (Some(ca), true) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(read_roots(ca)?, provider())
                        .build()
                        .map_err(|err| error(format!("client verification with {ca}: {err}")))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let config = builder
            .with_single_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|err| error(format!("{cert} with {key}: {err}")))?;
        Ok(Some(Arc::new(config)))
    }

    fn client_config(&self) -> Result<Option<Arc<ClientConfig>>, TransportError> {
        let Some(ca) = &self.ca else {
            return Ok(None);
        };
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|err| error(err.to_string()))?
            .with_root_certificates(read_roots(ca)?);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
                .map_err(|err| error(format!("{cert} with {key}: {err}")))?,
            _ => builder.with_no_client_auth(),
        };
        Ok(Some(Arc::new(config)))
    }
}

/// Reads the TLS files a broker's settings name, as its listeners and
/// dialed routes will (a certificate with its key, the authorities), so a
/// file that cannot be used is reported before anything opens.
pub fn check_files(
    cert: Option<&str>,
    key: Option<&str>,
    ca: Option<&str>,
    verify_clients: bool,
) -> Result<(), TransportError> {
    let files = TlsFiles {
        cert: cert.map(str::to_string),
        key: key.map(str::to_string),
        ca: ca.map(str::to_string),
        verify_clients,
        server_name: None,
    };
    files.server_config()?;
    files.client_config()?;
    Ok(())
}

/// What an endpoint needs to speak TLS: the server side (when it listens
/// with a certificate) and the client side (when it trusts a CA).
#[derive(Debug)]
pub struct TlsContext {
    files: TlsFiles,
    server: Option<Arc<ServerConfig>>,
    client: Option<Arc<ClientConfig>>,
    /// What the last reload replaced, for [`revert`](Self::revert).
    replaced: Option<Replaced>,
}

/// The server and client sides a reload replaced.
#[derive(Debug)]
struct Replaced {
    server: Option<Arc<ServerConfig>>,
    client: Option<Arc<ClientConfig>>,
}

impl TlsContext {
    /// The context the options of `config` ask for; `None` when they name
    /// no TLS file. `listens` says whether the endpoint accepts.
    pub fn from_config(
        config: &EndpointConfig,
        listens: bool,
    ) -> Result<Option<TlsContext>, TransportError> {
        let files = TlsFiles::from_config(config)?;
        if files == TlsFiles::default() {
            return Ok(None);
        }
        if listens && files.cert.is_none() {
            return Err(error(
                "a listener with TLS needs tls_cert and tls_key".to_string(),
            ));
        }
        let mut context = TlsContext {
            files,
            server: None,
            client: None,
            replaced: None,
        };
        context.reload()?;
        Ok(Some(context))
    }

    /// Reads the certificate, key and CA files again; on failure the
    /// configuration in use stays.
    pub fn reload(&mut self) -> Result<(), TransportError> {
        let server = self.files.server_config()?;
        let client = self.files.client_config()?;
        self.replaced = Some(Replaced {
            server: std::mem::replace(&mut self.server, server),
            client: std::mem::replace(&mut self.client, client),
        });
        Ok(())
    }

    /// Puts back what the last [`reload`](Self::reload) replaced (when
    /// another endpoint's reload failed: all take the new files or none).
    pub fn revert(&mut self) {
        if let Some(Replaced { server, client }) = self.replaced.take() {
            self.server = server;
            self.client = client;
        }
    }

    /// Whether accepted connections speak TLS.
    pub fn accepts(&self) -> bool {
        self.server.is_some()
    }

    /// A server session for an accepted connection.
    pub fn accept(&self) -> Result<Option<Connection>, TransportError> {
        match &self.server {
            None => Ok(None),
            Some(config) => ServerConnection::new(config.clone())
                .map(|session| Some(Connection::Server(session)))
                .map_err(|err| error(err.to_string())),
        }
    }

    /// A client session towards `host` (or the configured
    /// `tls_server_name`). An endpoint with TLS dials only with TLS: one
    /// that accepts TLS but has no authority to verify servers with cannot
    /// dial at all.
    pub fn connect(&self, host: &str) -> Result<Connection, TransportError> {
        let Some(config) = &self.client else {
            return Err(error(
                "this endpoint speaks TLS and has no authority to verify the server it dials \
                 (tls_ca); it does not dial in cleartext"
                    .to_string(),
            ));
        };
        let name = self.files.server_name.as_deref().unwrap_or(host);
        let name = ServerName::try_from(name.to_string()).map_err(|err| {
            error(format!(
                "{name:?} is not a name to verify a server certificate against: {err}"
            ))
        })?;
        ClientConnection::new(config.clone(), name)
            .map(Connection::Client)
            .map_err(|err| error(err.to_string()))
    }
}

/// The host part of `HOST:PORT` (`[v6]:port` gives `v6`).
pub fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A connection's socket, with its TLS session when it has one.
#[derive(Debug)]
pub struct Wire {
    stream: TcpStream,
    session: Option<Mutex<Connection>>,
}

impl Deref for Wire {
    type Target = TcpStream;

    fn deref(&self) -> &TcpStream {
        &self.stream
    }
}

fn tls_failure(err: rustls::Error) -> io::Error {
    let hint = match err {
        // What arrives where a TLS record should be is not one.
        rustls::Error::InvalidMessage(_) => {
            "; the peer does not speak TLS (connect with TLS, \
             given the authority to verify the server with)"
        }
        _ => "",
    };
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {err}{hint}"))
}

impl Wire {
    pub fn new(stream: TcpStream, session: Option<Connection>) -> Wire {
        Wire {
            stream,
            session: session.map(Mutex::new),
        }
    }

    pub fn is_tls(&self) -> bool {
        self.session.is_some()
    }

    /// The end-entity certificate the peer presented (verified by the
    /// session's configuration), if any.
    pub fn peer_certificate(&self) -> Option<Vec<u8>> {
        let session = self.session.as_ref()?.lock();
        session
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| cert.as_ref().to_vec())
    }

    /// Reads plaintext: `Ok(0)` at the end of the stream, `WouldBlock`
    /// when nothing more has arrived. With TLS it reads until the socket
    /// would block or plaintext is there (the session may hold more than
    /// one read returns: read until `WouldBlock`).
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(session) = &self.session else {
            return (&self.stream).read(buf);
        };
        let mut session = session.lock();
        let mut at_end = false;
        loop {
            match session.reader().read(buf) {
                Ok(n) => return Ok(n),
                // A peer that went without a close_notify ends the stream
                // as a TCP peer would; a frame it cut short is still seen
                // as unfinished.
                Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    if at_end {
                        return Ok(0);
                    }
                }
                Err(err) => return Err(err),
            }
            match session.read_tls(&mut &self.stream) {
                Ok(0) => at_end = true,
                Ok(_) => {}
                Err(err) => return Err(err),
            }
            if let Err(err) = session.process_new_packets() {
                // The alert tells the peer why, where the socket takes it.
                let _ = session.write_tls(&mut &self.stream);
                return Err(tls_failure(err));
            }
            // Handshake messages, and what waited for the handshake.
            Self::push(&mut session, &self.stream)?;
        }
    }

    /// Writes ciphertext the session holds until the socket would block.
    /// `Ok(true)` when none is left.
    fn push(session: &mut Connection, stream: &TcpStream) -> io::Result<bool> {
        while session.wants_write() {
            match session.write_tls(&mut &*stream) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "socket accepted no bytes",
                    ))
                }
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        Ok(true)
    }

    /// Writes plaintext; with TLS, ciphertext still waiting goes first and
    /// nothing more is taken until it is out (`WouldBlock`).
    pub fn write_vectored(&self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
        let Some(session) = &self.session else {
            return (&self.stream).write_vectored(parts);
        };
        let mut session = session.lock();
        if !Self::push(&mut session, &self.stream)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let taken = session.writer().write_vectored(parts)?;
        Self::push(&mut session, &self.stream)?;
        if taken == 0 && parts.iter().any(|part| !part.is_empty()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(taken)
    }

    /// Whether the session holds bytes not yet on the socket: ciphertext
    /// the socket did not take, or plaintext waiting for the handshake.
    pub fn has_pending(&self) -> bool {
        self.session.as_ref().is_some_and(|session| {
            let session = session.lock();
            session.wants_write() || session.is_handshaking()
        })
    }

    /// Writes waiting ciphertext; `Ok(true)` when nothing is left
    /// pending (see [`has_pending`](Self::has_pending)).
    pub fn flush_pending(&self) -> io::Result<bool> {
        match &self.session {
            None => Ok(true),
            Some(session) => {
                let mut session = session.lock();
                Ok(Self::push(&mut session, &self.stream)? && !session.is_handshaking())
            }
        }
    }

    /// Ends the sending side: a TLS close_notify (best effort), then FIN.
    pub fn shutdown_write(&self) -> io::Result<()> {
        if let Some(session) = &self.session {
            let mut session = session.lock();
            session.send_close_notify();
            let _ = Self::push(&mut session, &self.stream);
        }
        self.stream.shutdown(Shutdown::Write)
    }
}
