#!/usr/bin/env python3
"""Two textual rewrites that macros cannot express; line numbers are preserved.
 1. [[threadgroup(N)]]  -> [[mtl_threadgroup_arg(N)]]   (macro name clash with the qualifier)
 2. a statement that declares a threadgroup *variable* (starts with `threadgroup`,
    no '*' or '&' before the ';' outside [array bounds], no '(' i.e. not a parameter/function)
    -> `MTL_TG_VAR ...`  (static storage shared by the threadgroup's threads)
 3. [[kernel]] -> kernel
 4. append MTL_EXPORT(name) for every non-template kernel (instantiates it; exports it in EXEC mode);
    template kernels are exported by MTL_EXPORT_AS through shaders/metal/common.h INSTANTIATE
(crates/lily-core/src/backend/metal/sim.rs does the same rewrites in Rust; keep them in step)
usage: mtl_lower.py in.metal out.metal
"""
import re, sys
src = open(sys.argv[1]).read()
src = re.sub(r'\[\[\s*threadgroup\s*\(', '[[mtl_threadgroup_arg(', src)
src = re.sub(r'\[\[\s*kernel\s*\]\]', 'kernel', src)
src = re.sub(r'(?m)^(\s*)threadgroup\b(?=(?:[^;*&(){}\[]|\[[^\]]*\])*;)', r'\1MTL_TG_VAR', src)
kernels = re.findall(r'(?:\bkernel|\[\[\s*kernel\s*\]\])\s+void\s+(\w+)', src)
out = '#line 1 "%s"\n' % sys.argv[1] + src + '\n' + ''.join('MTL_EXPORT(%s)\n' % k for k in kernels)
open(sys.argv[2], 'w').write(out)
