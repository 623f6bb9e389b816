//! dtANS-LLM (being written).
