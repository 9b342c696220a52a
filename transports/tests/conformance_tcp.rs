//! The endpoint conformance suite over TCP on loopback.

use efabus_transports::conformance::TcpFactory;

efabus_transports::connected_conformance_tests!(TcpFactory);
