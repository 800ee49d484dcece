//! Library half of the `tandem` command (being built).
