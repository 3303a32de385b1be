use candle_core::{DType, Device, Tensor};

use super::*;

fn layout() -> KvLayout {
    KvLayout {
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 2,
        dtype: DType::F32,
        keys: KeyOrder::Rows,
    }
}

/// `[n, 1, 2]` rows whose values name their position.
fn rows(from: usize, n: usize) -> Tensor {
    let v: Vec<f32> = (from..from + n)
        .flat_map(|p| [p as f32, -(p as f32)])
        .collect();
    Tensor::from_vec(v, (n, 1, 2), &Device::Cpu).unwrap()
}

#[test]
fn writes_and_views_go_through_a_scattered_table() {
    let mut kv = KvCache::paged(layout(), Device::Cpu, 8, 4);
    kv.register(1, vec![5, 2, 7], 0).unwrap();
    assert_eq!(
        kv.allocate(2, 4),
        Err(KvError::Mixed(2)),
        "tables, then a reservation"
    );
    kv.ensure_room(1, 10).unwrap();
    assert!(kv.ensure_room(1, 13).is_err(), "three blocks hold 12");
    kv.write(1, 1, 0, &rows(0, 6), &rows(100, 6)).unwrap();
    kv.write(1, 1, 6, &rows(6, 4), &rows(106, 4)).unwrap();
    kv.set_len(1, 10).unwrap();
    let (k, v) = kv.view(1, 1, 10).unwrap();
    assert_eq!(
        k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        rows(0, 10).flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    assert_eq!(
        v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        rows(100, 10)
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    );
    assert_eq!(kv.row(1, 5).unwrap(), 2 * 4 + 1);
    assert_eq!(
        kv.segments(1, 2, 8).unwrap(),
        vec![(22, 0, 2), (8, 2, 4), (28, 6, 2)]
    );
    assert!(matches!(
        kv.set_table(1, vec![8], None),
        Err(KvError::BadBlock { block: 8, .. })
    ));
}

#[test]
fn a_pool_with_its_keys_in_block_lanes_refuses_token_major_writes_and_views() {
    let lanes = KvLayout {
        keys: KeyOrder::BlockLanes,
        ..layout()
    };
    let mut kv = KvCache::paged(lanes, Device::Cpu, 8, 4);
    kv.register(1, vec![5, 2], 0).unwrap();
    let refused = Err(KvError::KeyOrder(KeyOrder::BlockLanes));
    assert_eq!(kv.write(1, 0, 0, &rows(0, 3), &rows(100, 3)), refused);
    assert_eq!(kv.view(1, 0, 3).map(|_| ()), refused);
    assert_eq!(kv.token_major_keys(), refused);
}

#[test]
fn two_slots_share_a_prefix_block_and_read_the_same_rows() {
    let mut kv = KvCache::paged(layout(), Device::Cpu, 8, 4);
    kv.register(1, vec![3, 4], 0).unwrap();
    kv.write(1, 0, 0, &rows(0, 6), &rows(0, 6)).unwrap();
    kv.set_len(1, 6).unwrap();
    // Slot 2 starts after the shared full block and writes its own.
    kv.register(2, vec![3, 6], 4).unwrap();
    kv.write(2, 0, 4, &rows(40, 2), &rows(40, 2)).unwrap();
    let (k1, _) = kv.view(1, 0, 6).unwrap();
    let (k2, _) = kv.view(2, 0, 6).unwrap();
    let (a, b): (Vec<f32>, Vec<f32>) = (
        k1.flatten_all().unwrap().to_vec1().unwrap(),
        k2.flatten_all().unwrap().to_vec1().unwrap(),
    );
    assert_eq!(a[..8], b[..8], "the shared block");
    assert_eq!(&a[8..10], &[4.0, -4.0]);
    assert_eq!(&b[8..10], &[40.0, -40.0]);
}

#[test]
fn an_own_cache_takes_blocks_as_it_grows_and_returns_rejected_drafts() {
    let mut kv = KvCache::own(layout(), Device::Cpu, 100, 4);
    kv.allocate(1, 40).unwrap();
    kv.ensure_room(1, 5).unwrap();
    assert_eq!(kv.table(1).unwrap().len(), 2);
    kv.set_len(1, 5).unwrap();
    kv.begin(1).unwrap();
    kv.ensure_room(1, 8).unwrap();
    kv.set_len(1, 13).unwrap();
    assert_eq!(kv.table(1).unwrap().len(), 4);
    kv.commit(1, 2).unwrap();
    assert_eq!((kv.len(1).unwrap(), kv.table(1).unwrap().len()), (7, 2));
    // The returned blocks are reused first.
    kv.allocate(2, 8).unwrap();
    kv.ensure_room(2, 8).unwrap();
    assert_eq!(kv.table(2).unwrap(), &[2, 3]);
    assert!(kv.ensure_room(1, 40).is_err(), "past the reservation");
    assert!(kv.free(1) && kv.free(2));
    assert_eq!(kv.reserved_tokens(), 0);
}

#[test]
fn a_pool_reserved_then_emptied_takes_tables_again() {
    let mut kv = KvCache::paged(layout(), Device::Cpu, 8, 4);
    kv.allocate(1, 8).unwrap();
    kv.ensure_room(1, 8).unwrap();
    assert!(matches!(kv.register(2, vec![5], 0), Err(KvError::Mixed(2))));
    assert!(kv.free(1));
    kv.register(2, vec![5], 0).unwrap();
    assert_eq!(kv.allocate(3, 4), Err(KvError::Mixed(3)));
    assert!(kv.free(2));
    assert_eq!(
        kv.allocate(3, 4),
        Err(KvError::Mixed(3)),
        "tables stay: cached blocks"
    );
}

/// `[n, 3]` hidden rows whose values name their position.
fn hidden_rows(from: usize, n: usize) -> Tensor {
    let v: Vec<f32> = (from..from + n)
        .flat_map(|p| [p as f32, 0.5, -(p as f32)])
        .collect();
    Tensor::from_vec(v, (n, 3), &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn hidden_rows_follow_the_table_survive_growth_and_are_shared_with_the_block() {
    let mut kv = KvCache::paged(layout(), Device::Cpu, 64, 4);
    assert!(!kv.stores_hidden());
    assert!(
        kv.write_hidden(1, 0, &hidden_rows(0, 1)).is_err(),
        "no slot"
    );
    kv.store_hidden(3, DType::F32);
    kv.register(1, vec![5, 2, 7], 0).unwrap();
    kv.write_hidden(1, 0, &hidden_rows(0, 6)).unwrap();
    kv.write_hidden(1, 6, &hidden_rows(6, 4)).unwrap();
    assert_eq!(
        values(&kv.hidden(1, 0, 10).unwrap()),
        values(&hidden_rows(0, 10))
    );
    assert_eq!(
        values(&kv.hidden(1, 3, 7).unwrap()),
        values(&hidden_rows(3, 4))
    );
    assert_eq!(kv.hidden(1, 4, 4).unwrap().dims(), &[0, 3]);
    assert!(kv.hidden(1, 8, 13).is_err(), "past the table");
    // A block far out grows the pool: the rows written so far move along.
    kv.set_table(1, vec![5, 2, 7, 60], None).unwrap();
    kv.write_hidden(1, 12, &hidden_rows(12, 2)).unwrap();
    assert_eq!(
        values(&kv.hidden(1, 0, 10).unwrap()),
        values(&hidden_rows(0, 10))
    );
    assert_eq!(
        values(&kv.hidden(1, 12, 14).unwrap()),
        values(&hidden_rows(12, 2))
    );
    // A second slot whose table starts with the first's blocks (a cached
    // prefix) reads the hidden rows its writer left there.
    kv.register(2, vec![5, 2, 9], 8).unwrap();
    kv.write_hidden(2, 8, &hidden_rows(108, 2)).unwrap();
    let mut want = values(&hidden_rows(0, 8));
    want.extend(values(&hidden_rows(108, 2)));
    assert_eq!(values(&kv.hidden(2, 0, 10).unwrap()), want);
}

#[test]
fn a_pass_writes_every_slots_hidden_rows_or_none() {
    let mut kv = KvCache::paged(layout(), Device::Cpu, 64, 4);
    kv.store_hidden(3, DType::F32);
    kv.register(1, vec![5, 2], 0).unwrap();
    kv.register(2, vec![9, 3], 0).unwrap();
    // A pass's rows: slot 2's two, then slot 1's five (across its blocks).
    let mut rows = values(&hidden_rows(200, 2));
    rows.extend(values(&hidden_rows(100, 5)));
    let pass = Tensor::from_vec(rows, (7, 3), &Device::Cpu).unwrap();
    kv.write_hidden_rows(&[(1, 0, 2..7), (2, 3, 0..2)], &pass)
        .unwrap();
    assert_eq!(
        values(&kv.hidden(1, 0, 5).unwrap()),
        values(&hidden_rows(100, 5))
    );
    assert_eq!(
        values(&kv.hidden(2, 3, 5).unwrap()),
        values(&hidden_rows(200, 2))
    );
    // Many runs go in one scatter: six slots, one row each.
    for slot in 10..16 {
        kv.register(slot, vec![20 + slot], 0).unwrap();
    }
    let writes: Vec<_> = (10..16)
        .map(|slot| (slot, 2, (slot - 10) as usize..(slot - 9) as usize))
        .collect();
    kv.write_hidden_rows(&writes, &hidden_rows(300, 6)).unwrap();
    for slot in 10..16u32 {
        let want = values(&hidden_rows(300 + (slot - 10) as usize, 1));
        assert_eq!(values(&kv.hidden(slot, 2, 3).unwrap()), want, "slot {slot}");
    }
    // Past slot 2's table: an error, and slot 1's rows stay as they were.
    let err = kv.write_hidden_rows(&[(1, 0, 0..2), (2, 7, 2..4)], &hidden_rows(0, 4));
    assert!(
        matches!(err, Err(KvError::OverReservation { slot: 2, .. })),
        "{err:?}"
    );
    assert_eq!(
        values(&kv.hidden(1, 0, 5).unwrap()),
        values(&hidden_rows(100, 5))
    );
}

#[test]
fn a_whole_pool_is_allocated_once_and_keeps_its_generation() {
    // A pool of known size, on the CPU as on CUDA.
    let mut kv = KvCache::paged(layout(), Device::Cpu, 64, 4);
    kv.register(1, vec![0], 0).unwrap();
    let generation = kv.pool_generation();
    assert_eq!(kv.pool_layer(0).unwrap().0.dim(0).unwrap(), 64 * 4);
    // Blocks far past any doubling step: no reallocation, so CUDA graphs
    // captured over the pool stay valid.
    kv.set_table(1, vec![0, 63], None).unwrap();
    kv.register(2, vec![40, 41, 42], 0).unwrap();
    assert_eq!(kv.pool_generation(), generation);
    // Every layer's K and V are buffers of their own (on the CPU, views of
    // one allocation): nothing written to one shows in another.
    let values = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for layer in 0..2 {
        let at = 1000 * layer;
        kv.write(2, layer, 0, &rows(at, 12), &rows(at + 500, 12))
            .unwrap();
    }
    kv.set_len(2, 12).unwrap();
    for layer in 0..2 {
        let (k, v) = kv.view(2, layer, 12).unwrap();
        let at = 1000 * layer;
        assert_eq!(values(k), values(rows(at, 12)), "layer {layer}'s keys");
        assert_eq!(
            values(v),
            values(rows(at + 500, 12)),
            "layer {layer}'s values"
        );
    }
}

/// A pool sized past what the host gives at once (here, past the address
/// space) still serves: it grows as used instead of failing every request.
#[test]
fn a_pool_too_big_to_allocate_whole_grows_as_used() {
    let mut kv = KvCache::paged(layout(), Device::Cpu, 1 << 40, 4);
    kv.register(1, vec![0, 1], 0).unwrap();
    assert_eq!(kv.pool_layer(0).unwrap().0.dim(0).unwrap(), 16 * 4);
    kv.write(1, 0, 0, &rows(0, 6), &rows(500, 6)).unwrap();
    kv.set_len(1, 6).unwrap();
    // A block past the first allocation: the pool doubles and keeps rows.
    kv.register(2, vec![20], 0).unwrap();
    assert_eq!(kv.pool_layer(0).unwrap().0.dim(0).unwrap(), 32 * 4);
    let (k, v) = kv.view(1, 0, 6).unwrap();
    let values = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(values(k), values(rows(0, 6)));
    assert_eq!(values(v), values(rows(500, 6)));
}

#[test]
fn a_pool_of_no_set_size_doubles_to_the_highest_block_and_renames_itself() {
    let mut kv = KvCache::own(layout(), Device::Cpu, 1 << 12, 4);
    kv.allocate(1, 4).unwrap();
    kv.ensure_room(1, 4).unwrap();
    let first = kv.pool_generation();
    assert_eq!(kv.pool_layer(0).unwrap().0.dim(0).unwrap(), 16 * 4);
    // 21 more blocks (1..=21): the highest, 22 blocks, is under double.
    kv.allocate(2, 84).unwrap();
    kv.ensure_room(2, 84).unwrap();
    assert_eq!(kv.pool_layer(0).unwrap().0.dim(0).unwrap(), 32 * 4);
    assert_ne!(
        kv.pool_generation(),
        first,
        "a reallocation names new buffers"
    );
}
