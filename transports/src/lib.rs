//! efabus-transports: the in-process, TCP and libfabric transports and the
//! scheme registry that selects them from endpoint strings.

pub mod fabric;
