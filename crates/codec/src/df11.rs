//! DFloat11-layout Huffman coder (being written).
