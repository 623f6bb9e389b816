#!/usr/bin/env python3
"""The reference of a quantised GGUF: the same file with every tensor dequantised to F32 by the
`gguf` package (gguf-py's numpy port of ggml's dequantisation, the reference implementation),
metadata copied. `entrollm eval ppl Q.gguf --reference Q-f32.gguf --file TEXT` then compares the
engine on the quantised blocks with its f32 path on the reference's weights.

    python3 tools/gguf_f32_reference.py Q.gguf Q-f32.gguf
"""
import sys

import numpy as np
import gguf


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1:]
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            value = [f.contents(i) for i in range(len(f.data))]
            w.add_key_value(name, value, t, sub_type=f.types[1])
        else:
            w.add_key_value(name, f.contents(), t)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # gguf-py's shape is ggml's (columns first); numpy's is rows first.
        shape = tuple(int(d) for d in reversed(t.shape))
        w.add_tensor(t.name, data.reshape(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
