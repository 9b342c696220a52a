//! The endpoint conformance suite over the in-process transport.

use efabus_transports::conformance::MemFactory;

efabus_transports::connected_conformance_tests!(MemFactory);
