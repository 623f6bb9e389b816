//! histograms (being written).
