//! matvec (being written).
