//! The endpoint conformance suite over TCP with TLS on loopback, with
//! server authentication only and with mutual TLS.

mod server_authenticated {
    use efabus_transports::conformance::TlsFactory;

    efabus_transports::connected_conformance_tests!(TlsFactory { mutual: false });
}

mod mutual {
    use efabus_transports::conformance::TlsFactory;

    efabus_transports::connected_conformance_tests!(TlsFactory { mutual: true });
}
