//! The reductions' subgroup path: where the adapter has `SUBGROUP` the kernels run it (whole
//! subgroups of a size the adapter reports), and opened without it they do not. That both
//! paths give the same bits is checked kernel by kernel in `norms`, `losses`, `optimizers`
//! and `kv_attention`.

use snug_gpu::kernels::subgroup::subgroup_layout;

use crate::common::{gpu, gpu_no_subgroups};

#[test]
fn the_reductions_use_subgroups_where_the_adapter_has_them() {
    let (Some(device), Some(plain)) = (gpu(), gpu_no_subgroups()) else {
        return;
    };
    assert_eq!(subgroup_layout(plain).expect("no launch"), None);
    assert!(!plain.has_subgroups());
    let info = device.info();
    assert_eq!(
        device.has_subgroups(),
        info.subgroup && snug_gpu::subgroups_allowed()
    );
    let Some(layout) = subgroup_layout(device).expect("the probe runs") else {
        assert!(!device.has_subgroups());
        eprintln!("{}: no subgroup operations; the plain path only", info.name);
        return;
    };
    eprintln!("{}: {layout:?}", info.name);
    let [min, max] = info.subgroup_sizes;
    assert!(
        (min..=max).contains(&layout.size),
        "{layout:?} outside the adapter's {min}..={max}"
    );
    assert!(
        layout.shuffles(),
        "{layout:?}: the reductions would take the tree"
    );
}
