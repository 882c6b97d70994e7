//! Adapters, opening a device, device memory (the source's counters, the arena's slot checks)
//! and transfers, on the first adapter (lavapipe in CI).

mod common;

use common::gpu;
use snug_gpu::{adapters, transfer, Arena, GpuDevice, GpuError, MemorySource, Selector, Slot};

#[test]
fn adapters_report_the_limits_the_arena_and_kernels_rely_on() {
    let found = adapters();
    if found.is_empty() {
        snug_testkit::skip_or_fail("no GPU adapter");
        return;
    }
    for (i, a) in found.iter().enumerate() {
        eprintln!("gpu:{i} {a:#?}");
        assert_eq!(a.index, i);
        assert!(!a.name.is_empty());
        assert!(a.max_buffer_size >= 1 << 28, "{a:?}");
        assert!(a.max_storage_buffer_binding_size >= 1 << 27, "{a:?}");
        assert!(a.min_storage_buffer_offset_alignment.is_power_of_two());
        // The kernels' workgroups: 256 threads in x, or 16 × 16.
        assert!(a.max_compute_invocations_per_workgroup >= 256);
        assert!(a.max_compute_workgroup_size[0] >= 256 && a.max_compute_workgroup_size[1] >= 16);
        assert!(a.max_compute_workgroup_storage_size >= 16 << 10);
        assert!(a.max_storage_buffers_per_shader_stage >= 8);
    }
}

#[test]
fn an_index_past_the_adapters_lists_them_or_says_how_to_install_a_driver() {
    let found = adapters();
    let err = GpuDevice::open(Selector::Index(found.len())).unwrap_err();
    if found.is_empty() {
        assert!(matches!(err, GpuError::NoAdapter), "{err}");
        assert!(err.to_string().contains("mesa-vulkan-drivers"), "{err}");
        return;
    }
    assert!(
        matches!(err, GpuError::AdapterIndex { index, .. } if index == found.len()),
        "{err}"
    );
    let msg = err.to_string();
    for a in &found {
        assert!(msg.contains(&format!("gpu:{}", a.index)), "{msg}");
        assert!(msg.contains(&a.name), "{msg}");
    }
}

#[test]
fn the_memory_source_counts_active_and_peak_bytes() {
    let Some(device) = gpu() else { return };
    let source = MemorySource::new(device);
    let a = source.allocate(1000).expect("1000 bytes");
    let b = source.allocate(4096).expect("4096 bytes");
    assert_eq!((a.bytes(), b.bytes()), (1000, 4096));
    assert_eq!(source.active_bytes(), 5096);
    source.release(a);
    // Sizes round up to whole words, as copies need.
    let c = source.allocate(5).expect("5 bytes");
    assert_eq!(c.bytes(), 8);
    assert_eq!((source.active_bytes(), source.peak_bytes()), (4104, 5096));
    source.release(b);
    source.release(c);
    assert_eq!((source.active_bytes(), source.peak_bytes()), (0, 5096));
}

#[test]
fn a_buffer_past_the_device_limit_is_refused_by_name() {
    let Some(device) = gpu() else { return };
    let source = MemorySource::new(device);
    let max = device.limits().max_buffer_size;
    let err = source.allocate(max + 4).unwrap_err();
    assert!(
        matches!(&err, GpuError::BufferTooLarge { device: d, max: m, .. } if d == device.name() && *m == max),
        "{err}"
    );
    assert_eq!(source.active_bytes(), 0);
}

#[test]
fn slots_are_checked_against_the_device_rules() {
    let Some(device) = gpu() else { return };
    let source = MemorySource::new(device);
    let align = u64::from(device.limits().min_storage_buffer_offset_alignment);
    let arena = Arena::allocate(&source, &[4 * align, 2 * align]).expect("two chunks");
    assert_eq!(source.active_bytes(), 6 * align);
    assert!(arena.slice(Slot::new(1, align, align)).is_ok());
    let max_binding = device.limits().max_storage_buffer_binding_size;
    for (slot, needle) in [
        (Slot::new(2, 0, 4), "chunks"),
        (Slot::new(0, align / 2, 4), "multiple of"),
        (Slot::new(0, 0, 6), "multiple of 4"),
        (Slot::new(0, 3 * align, 2 * align), "holds"),
        (Slot::new(0, 0, max_binding + 4), "largest binding"),
    ] {
        let Err(err) = arena.slice(slot) else {
            panic!("{slot:?} was accepted");
        };
        assert!(matches!(err, GpuError::Binding { .. }), "{err}");
        assert!(err.to_string().contains(needle), "{slot:?}: {err}");
    }
    arena.release(&source);
    assert_eq!(source.active_bytes(), 0);
}

#[test]
fn uploads_and_downloads_round_trip_at_offsets_in_two_chunks() {
    let Some(device) = gpu() else { return };
    let source = MemorySource::new(device);
    let align = u64::from(device.limits().min_storage_buffer_offset_alignment);
    let arena = Arena::allocate(&source, &[8 * align, 8 * align]).expect("two chunks");
    let first: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
    let second: Vec<i32> = (0..11).map(|i| i * 7 - 20).collect();
    let s1 = arena.slice(Slot::new(0, 2 * align, 37 * 4)).expect("slot");
    let s2 = arena.slice(Slot::new(1, align, 11 * 4)).expect("slot");
    transfer::upload_f32(device, &s1, &first).expect("upload");
    transfer::upload_i32(device, &s2, &second).expect("upload");
    assert_eq!(
        transfer::download_f32(device, &s1).expect("download"),
        first
    );
    let back: Vec<i32> =
        bytemuck::pod_collect_to_vec(&transfer::download(device, &s2).expect("download"));
    assert_eq!(back, second);
    // A copy that is not whole words, or longer than the slot, is refused before it runs.
    for data in [vec![0u8; 6], vec![0u8; 37 * 4 + 4]] {
        let err = transfer::upload(device, &s1, &data).unwrap_err();
        assert!(matches!(err, GpuError::Binding { .. }), "{err}");
    }
    arena.release(&source);
}

#[test]
fn a_launch_error_is_reported_at_submit_not_panicked() {
    if gpu().is_none() {
        return;
    }
    // A device of its own: wgpu reports such errors to the device, where a test running beside
    // this one on the shared device could take it.
    let own = GpuDevice::open(Selector::FirstGpu).expect("a second device");
    let device = &own;
    let source = MemorySource::new(device);
    let a = source.allocate(16).expect("a buffer");
    let b = source.allocate(16).expect("a buffer");
    // Copying a range past the end is a wgpu validation error: it must come back typed.
    let mut encoder = device.encoder("bad copy");
    encoder.copy_buffer_to_buffer(a.buffer(), 0, b.buffer(), 8, 16);
    let err = device
        .submit(encoder)
        .and_then(|_| device.wait())
        .unwrap_err();
    assert!(matches!(err, GpuError::Backend { .. }), "{err}");
    // The error is taken: the device goes on working.
    transfer::upload_f32(device, &a.whole(), &[1.0, 2.0, 3.0, 4.0]).expect("upload");
    assert_eq!(
        transfer::download_f32(device, &a.whole()).expect("download"),
        [1.0, 2.0, 3.0, 4.0]
    );
    source.release(a);
    source.release(b);
}

/// A device that refuses an allocation mid-run (here: past a lowered largest buffer) is the
/// runtime's typed out-of-memory error on that device, the device's refusal ("refused by the
/// device"), and nothing is left allocated.
#[test]
fn a_refused_allocation_is_out_of_memory_on_the_device() {
    use snug_runtime::{Backend, Device};
    let Some(device) = gpu() else { return };
    let backend = snug_gpu::GpuBackend::new(device.with_max_buffer_size(1 << 16));
    let small = backend
        .allocator()
        .alloc(4096)
        .expect("within the device's buffers");
    let err = backend.allocator().alloc(1 << 20).unwrap_err();
    let index = u32::try_from(device.info().index).unwrap();
    assert_eq!(err.device, Device::Gpu(index), "{err}");
    assert_eq!(err.limit, usize::MAX, "{err}");
    assert!(
        err.to_string()
            .starts_with(&format!("out of memory on gpu:{index}"))
            && err.to_string().ends_with("refused by the device"),
        "{err}"
    );
    drop(small);
    backend.allocator().clear_cache();
    assert_eq!(backend.memory().device_active_bytes(), 0);
}
