"""PyTorch's (MKL's) f32 GEMM GFLOP/s for the products of memfit's bench cases, median of 15.

Usage: PYTHON tools/torch_gemm.py [threads]. The same cases, in the same order, as
`cargo run --release -p memfit-kernels --example gemm_bench -- [threads]`; run both in one go.
"""
import torch, time, sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv)>1 else 2)
# (name, m, n, k, layout) C[m,n] = A[m,k] B[k,n]; NT: B given as [n,k]; TN: A given as [k,m]
cases = [
 ("mlp fwd 784->1024", 256,1024,784,"NT"),
 ("mlp fwd 1024->1024",256,1024,1024,"NT"),
 ("mlp dW",1024,784,256,"TN"),
 ("mlp dX",256,784,1024,"NN"),
 ("gpt qkv fwd",4096,768,256,"NT"),
 ("gpt fc1 fwd",4096,1024,256,"NT"),
 ("gpt fc2 fwd",4096,256,1024,"NT"),
 ("gpt dX fc1",4096,256,1024,"NN"),
 ("gpt dW fc1",1024,256,4096,"TN"),
 ("gpt dW fc2",256,1024,4096,"TN"),
 ("gpt ln dX block attn",512,256,768,"NN"),
 ("gpt ln dX block mlp",512,256,1024,"NN"),
 ("gpt ln dW block mlp",1024,256,512,"TN"),
 ("sq 1024",1024,1024,1024,"NN"),
]
for name,m,n,k,lay in cases:
    a = torch.randn(k,m).t() if lay=="TN" else torch.randn(m,k)
    b = torch.randn(n,k).t() if lay=="NT" else torch.randn(k,n)
    c = torch.empty(m,n)
    for _ in range(3): torch.matmul(a,b,out=c)
    ts=[]
    for _ in range(15):
        reps=0; t0=time.perf_counter()
        while True:
            torch.matmul(a,b,out=c); reps+=1
            t=time.perf_counter()-t0
            if t>0.02: break
        ts.append(t/reps)
    ts.sort(); t=ts[len(ts)//2]
    print(f"{name:22s} {m:5d} {n:5d} {k:5d} {lay} {2*m*n*k/t/1e9:7.1f} GFLOP/s")
