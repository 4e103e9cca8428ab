//! Checks every collective of [`memfit_dist::collective`] between real ranks and measures all-reduce
//! bandwidth: `mpirun -np 2 memfit-collectives [--bandwidth MiB]`. Exits non-zero (aborting the job)
//! when any result is wrong. `--panic-on-rank R` makes rank R panic while the others wait in a
//! collective, to show that the panic hook ends the whole job. Used by `crates/dist/tests/mpi.rs`.

use memfit_dist::collective;
use memfit_dist::mpi::Mpi;
use memfit_dist::{GradientBucket, Group};
use memfit_tensor::{Category, Device, Tensor};

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 1000 + i) as f32).collect()
}

fn tensor(device: &Device, v: &[f32]) -> Tensor {
    Tensor::from_slice(device, v, &[v.len()], Category::Communication).expect("host tensor")
}

fn check(group: &dyn Group, what: &str, got: Vec<f32>, want: Vec<f32>) {
    if got != want {
        eprintln!("rank {}: {what} wrong: got {:?}.., want {:?}..", group.rank(), &got[..4], &want[..4]);
        group.abort(3);
    }
}

fn main() {
    let mpi = Mpi::init().unwrap_or_else(|e| {
        eprintln!("memfit-collectives: {e}");
        std::process::exit(2)
    });
    let group: &dyn Group = &mpi;
    let (rank, size) = (group.rank(), group.size());
    let device = Device::cpu();
    let panicking = std::env::args().skip_while(|a| a != "--panic-on-rank").nth(1).and_then(|r| r.parse().ok());
    if panicking == Some(rank) {
        panic!("rank {rank} panics on purpose (--panic-on-rank)");
    }
    let n = 1000;
    let sum: Vec<f32> = (0..n).map(|i| (0..size).map(|r| (r * 1000 + i) as f32).sum()).collect();

    let out = tensor(&device, &vec![0.0; n]);
    collective::all_reduce_sum(group, &tensor(&device, &values(rank, n)), &out).unwrap();
    check(group, "all-reduce", out.to_vec().unwrap(), sum.clone());

    let t = tensor(&device, &values(rank, n));
    collective::broadcast(group, &t, size - 1).unwrap();
    check(group, "broadcast", t.to_vec().unwrap(), values(size - 1, n));

    let out = tensor(&device, &vec![0.0; n * size]);
    collective::all_gather(group, &tensor(&device, &values(rank, n)), &out).unwrap();
    check(group, "all-gather", out.to_vec().unwrap(), (0..size).flat_map(|r| values(r, n)).collect());

    let full: Vec<f32> = (0..n * size).map(|i| (rank + i) as f32).collect();
    let out = tensor(&device, &vec![0.0; n]);
    collective::reduce_scatter_sum(group, &tensor(&device, &full), &out).unwrap();
    let want = (rank * n..(rank + 1) * n).map(|i| (0..size).map(|r| (r + i) as f32).sum()).collect();
    check(group, "reduce-scatter", out.to_vec().unwrap(), want);

    // A ring: each rank sends to the next and receives from the previous.
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let got = tensor(&device, &vec![0.0; n]);
    if rank % 2 == 0 {
        collective::send(group, &tensor(&device, &values(rank, n)), next).unwrap();
        collective::receive(group, &got, prev).unwrap();
    } else {
        collective::receive(group, &got, prev).unwrap();
        collective::send(group, &tensor(&device, &values(rank, n)), next).unwrap();
    }
    check(group, "send/receive", got.to_vec().unwrap(), values(prev, n));

    // Host bytes from the last rank (a plan's inputs).
    let text: &[u8] = if rank == size - 1 { b"rank 1's cost model" } else { b"" };
    let got = collective::broadcast_bytes(group, text, size - 1);
    check(
        group,
        "broadcast of bytes",
        got.iter().map(|&b| f32::from(b)).collect(),
        b"rank 1's cost model".iter().map(|&b| f32::from(b)).collect(),
    );

    // Gradients through a bucket smaller than a parameter, one parameter without a gradient.
    let params: Vec<Tensor> = [700, 1, 300].iter().map(|&k| tensor(&device, &vec![0.0; k])).collect();
    for (i, p) in params.iter().enumerate().filter(|&(i, _)| !(i == 1 && rank == 0)) {
        p.set_grad(Some(tensor(&device, &values(rank + i, p.numel()))));
    }
    let bucket = GradientBucket::new(&device, 1001, 256 * 4).unwrap();
    bucket.all_reduce(group, &params).unwrap();
    for (i, p) in params.iter().enumerate() {
        let want = (0..p.numel())
            .map(|j| (0..size).filter(|&r| !(i == 1 && r == 0)).map(|r| ((r + i) * 1000 + j) as f32).sum())
            .collect();
        check(group, &format!("bucketed gradient {i}"), p.grad().unwrap().to_vec().unwrap(), want);
    }

    if let Some(mib) = std::env::args().skip_while(|a| a != "--bandwidth").nth(1) {
        let mib: usize = mib.parse().expect("--bandwidth MiB");
        let elems = mib << 18;
        let (a, b) = (tensor(&device, &vec![1.0; elems]), tensor(&device, &vec![0.0; elems]));
        let mut times = Vec::new();
        for _ in 0..7 {
            let start = std::time::Instant::now();
            collective::all_reduce_sum(group, &a, &b).unwrap();
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(|x, y| x.total_cmp(y));
        if rank == 0 {
            let median = times[times.len() / 2];
            println!(
                "all-reduce of {mib} MiB f32 across {size} ranks: median {:.1} ms, {:.2} GB/s (algorithm bandwidth)",
                median * 1e3,
                (elems * 4) as f64 / median / 1e9
            );
        }
    }
    if rank == 0 {
        println!("collectives ok on {size} ranks");
    }
}
