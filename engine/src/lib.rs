//! tandem inference engine (being built).
