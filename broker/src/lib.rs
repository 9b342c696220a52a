//! efabus-broker: the event loop, sessions, fan-out, flow control, the
//! embedded API, the client and the command-line interface.
