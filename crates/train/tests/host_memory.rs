//! Invariant 1 seen from the host: beyond the allocator's own segments (memory maps of their own,
//! not heap), a training step's heap use is small and does not grow with the batch, so no kernel
//! (memfit-kernels' GEMM and math included) keeps a tensor-sized buffer outside the allocator. Every
//! heap allocation of this test binary is counted by a wrapping global allocator.

mod common;

use common::*;
use memfit_nn::{ModelKind, ModelSpec};
use memfit_tensor::{Device, DeviceKind};
use memfit_train::samples::synthetic;
use memfit_train::Session;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts live heap bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to the system allocator; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Heap bytes a steady-state training step adds at its peak (the allocator's segments are memory
/// maps, not heap, so all of it is memory outside the allocator).
fn outside_bytes(spec: &ModelSpec, batch: usize) -> usize {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let dev: Device = device(DeviceKind::Cpu, None, None);
        let mut session = Session::new(dev.clone(), spec, adamw(), 1).unwrap();
        let samples = synthetic(spec, 2 * batch, 5);
        // The first steps create the optimizer state and every thread's GEMM workspace.
        session.run(samples.as_ref(), None, &opts(batch, batch, 2), &mut |_| {}).unwrap();
        let heap_before = LIVE.load(Ordering::Relaxed);
        PEAK.store(heap_before, Ordering::Relaxed);
        session.run(samples.as_ref(), None, &opts(batch, batch, 1), &mut |_| {}).unwrap();
        PEAK.load(Ordering::Relaxed) - heap_before
    })
}

#[test]
fn a_step_keeps_no_batch_sized_memory_outside_the_allocator() {
    let gpt = ModelSpec::gpt(memfit_nn::GptConfig { vocab: 40, d_model: 64, heads: 4, layers: 2, max_t: 64 });
    let cases = [
        ("mlp", ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10), 32),
        ("simplecnn", ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10), 32),
        ("resnet", small_spec(ModelKind::ResNet), 16),
        ("gpt", gpt, 8),
    ];
    for (name, spec, batch) in cases {
        let small = outside_bytes(&spec, batch);
        let large = outside_bytes(&spec, 4 * batch);
        // Graph nodes and bookkeeping scale with the number of ops, not with the batch; a GEMM that
        // work stealing nests on a busy thread for the first time adds one bounded packing
        // workspace. One activation of the large batch would be far above this slack.
        let slack = (256 << 10) + memfit_kernels::gemm::WORKSPACE_BYTES_PER_THREAD;
        assert!(
            large <= small + slack,
            "{name}: {large} bytes outside the allocator at batch {} vs {small} at {batch}",
            4 * batch
        );
        assert!(small <= 16 << 20, "{name}: {small} bytes outside the allocator");
        println!("{name}: {small} / {large} bytes outside the allocator at batch {batch} / {}", 4 * batch);
    }
}
