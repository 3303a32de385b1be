// Standalone read-bandwidth experiments behind BENCHMARKS.md's session-4
// notes on the CPU decode kernel (not part of the crate or its tests).
// Build and run (x86-64 with AVX-512):
//   rustc -O -C target-feature=+avx512f,+fma bench/cpu/gemv_stream.rs -o /tmp/gemv_stream
//   /tmp/gemv_stream N K ROUNDS VARIANTS   e.g. 32000 768 10 sumc,n8p0,n4p0,g8p1
// Weights: N×K f32 on 2 MiB pages (NOHUGE=1: 4 KiB), as many copies as make
// ~400 MB; two threads (a spinning team). Each round times every variant
// over all copies and prints GB/s medians:
//   sum   a plain sum, one contiguous half per thread;
//   sumc  a plain sum in cursor chunks (the kernels' split);
//   sum1  the C probe's single-accumulator sum;
//   g8pP  8 weight rows per tile, prefetch P (0 none, 1 next tile's rows,
//         2 4 KiB ahead, 3 two tiles ahead, 5/6 as 1/3 into L2);
//   g1pP  one row at a time, 4 accumulators (P: KiB ahead, 0 none);
//   nRp0  R ∈ {1, 2, 4, 8} rows per tile, one accumulator each, no prefetch.
// STEP=1 instead runs the 49 matmuls of a llama-100m decode step (one
// arena), each step after a plain sum of the same bytes, and prints the
// ratio; GAP=µs spins that long after each matmul; PFKB=n has each thread
// prefetch n KiB of its first chunk of the next matmul when it finishes.
#![allow(clippy::all)]
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicUsize, Ordering, AtomicBool};
use std::sync::Arc;
use std::time::Instant;

extern "C" { fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32; }

fn alloc_huge(n: usize) -> &'static mut [f32] {
    let bytes = n * 4;
    let layout = std::alloc::Layout::from_size_align(bytes.next_multiple_of(1 << 21), 1 << 21).unwrap();
    unsafe {
        let p = std::alloc::alloc(layout);
        if std::env::var("NOHUGE").is_err() { madvise(p, layout.size(), 14); }
        let s = std::slice::from_raw_parts_mut(p as *mut f32, n);
        let mut st = 12345u32;
        for v in s.iter_mut() { st ^= st << 13; st ^= st >> 17; st ^= st << 5; *v = (st as f32) * 1e-10; }
        s
    }
}

// Simple 2-thread team: worker spins on a generation counter.
struct Team { gen: AtomicUsize, done: AtomicUsize, job: std::sync::Mutex<Option<Arc<dyn Fn(usize) + Send + Sync>>>, stop: AtomicBool }
fn team_run(t: &Arc<Team>, f: Arc<dyn Fn(usize) + Send + Sync>) {
    *t.job.lock().unwrap() = Some(f.clone());
    t.done.store(0, Ordering::SeqCst);
    t.gen.fetch_add(1, Ordering::SeqCst);
    f(0);
    while t.done.load(Ordering::Acquire) < 1 { std::hint::spin_loop(); }
}

#[target_feature(enable = "avx512f")]
unsafe fn sum_range(a: *const f32, n: usize) -> f32 {
    let mut s0 = _mm512_setzero_ps(); let mut s1 = s0; let mut s2 = s0; let mut s3 = s0;
    let mut i = 0;
    while i + 64 <= n {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(a.add(i)));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(a.add(i+16)));
        s2 = _mm512_add_ps(s2, _mm512_loadu_ps(a.add(i+32)));
        s3 = _mm512_add_ps(s3, _mm512_loadu_ps(a.add(i+48)));
        i += 64;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0,s1),_mm512_add_ps(s2,s3)))
}

#[target_feature(enable = "avx512f")]
unsafe fn sum1(a: *const f32, n: usize) -> f32 {
    let mut s = _mm512_setzero_ps();
    let mut i = 0;
    while i + 64 <= n {
        s = _mm512_add_ps(s, _mm512_load_ps(a.add(i)));
        s = _mm512_add_ps(s, _mm512_load_ps(a.add(i+16)));
        s = _mm512_add_ps(s, _mm512_load_ps(a.add(i+32)));
        s = _mm512_add_ps(s, _mm512_load_ps(a.add(i+48)));
        i += 64;
    }
    _mm512_reduce_add_ps(s)
}
#[inline(always)]
unsafe fn hsum(v: __m512) -> f32 { _mm512_reduce_add_ps(v) }

// variant 0: 8 rows interleaved, prefetch mode pf: 0 none, 1 next-tile same cols, 2 +4KiB, 3 + 2 tiles
#[target_feature(enable = "avx512f")]
unsafe fn gemv8(x: *const f32, w: *const f32, k: usize, j0: usize, j1: usize, out: *mut f32, pf: u32) {
    let mut j = j0;
    while j < j1 {
        let rows: [*const f32; 8] = std::array::from_fn(|t| w.add((j + t) * k));
        let mut a = [_mm512_setzero_ps(); 8];
        let mut kk = 0;
        while kk < k {
            if pf != 0 {
                for p in rows {
                    let ah = match pf { 1|5 => p.wrapping_add(kk + 8 * k) as *const i8, 2 => (p.wrapping_add(kk) as *const i8).wrapping_add(4096), 3|6 => p.wrapping_add(kk + 16*k) as *const i8, _ => p.wrapping_add(kk + 32*k) as *const i8 };
                    if pf >= 5 { _mm_prefetch::<_MM_HINT_T1>(ah); } else { _mm_prefetch::<_MM_HINT_T0>(ah); }
                }
            }
            let xv = _mm512_loadu_ps(x.add(kk));
            for t in 0..8 { a[t] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(rows[t].add(kk)), a[t]); }
            kk += 16;
        }
        for t in 0..8 { *out.add(j + t) = hsum(a[t]); }
        j += 8;
    }
}

// variant: row-sequential, one row at a time with 4 accumulators
#[target_feature(enable = "avx512f")]
unsafe fn gemv1(x: *const f32, w: *const f32, k: usize, j0: usize, j1: usize, out: *mut f32, pf: u32) {
    for j in j0..j1 {
        let r = w.add(j * k);
        let mut a0 = _mm512_setzero_ps(); let mut a1 = a0; let mut a2 = a0; let mut a3 = a0;
        let mut kk = 0;
        while kk < k {
            if pf != 0 { _mm_prefetch::<_MM_HINT_T0>((r.add(kk) as *const i8).wrapping_add(pf as usize * 1024)); _mm_prefetch::<_MM_HINT_T0>((r.add(kk+32) as *const i8).wrapping_add(pf as usize * 1024)); }
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(kk)), _mm512_loadu_ps(r.add(kk)), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(kk+16)), _mm512_loadu_ps(r.add(kk+16)), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(kk+32)), _mm512_loadu_ps(r.add(kk+32)), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(kk+48)), _mm512_loadu_ps(r.add(kk+48)), a3);
            kk += 64;
        }
        *out.add(j) = hsum(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));
    }
}


#[target_feature(enable = "avx512f")]
unsafe fn gemvn<const NR: usize>(x: *const f32, w: *const f32, k: usize, j0: usize, j1: usize, out: *mut f32) {
    let mut j = j0;
    while j < j1 {
        let rows: [*const f32; NR] = std::array::from_fn(|t| w.add((j + t) * k));
        let mut a = [_mm512_setzero_ps(); NR];
        let mut kk = 0;
        while kk < k {
            let xv = _mm512_loadu_ps(x.add(kk));
            for t in 0..NR { a[t] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(rows[t].add(kk)), a[t]); }
            kk += 16;
        }
        for t in 0..NR { *out.add(j + t) = hsum(a[t]); }
        j += NR;
    }
}
fn step_mode() {
    let shapes: Vec<(usize, usize)> = { let mut v = vec![]; for _ in 0..12 { v.extend([(1280usize, 768usize), (768, 768), (4096, 768), (768, 2048)]); } v.push((32000, 768)); v };
    let total: usize = shapes.iter().map(|(n, k)| n * k).sum();
    let arena = alloc_huge(total); let ap = arena.as_ptr() as usize;
    let mut offs = vec![]; let mut o = 0; for (n, k) in &shapes { offs.push(o); o += n * k; }
    let x = alloc_huge(4096); let xp = x.as_ptr() as usize;
    let out = alloc_huge(32000); let op = out.as_mut_ptr() as usize;
    let team = Arc::new(Team { gen: AtomicUsize::new(0), done: AtomicUsize::new(0), job: std::sync::Mutex::new(None), stop: AtomicBool::new(false) });
    { let t = team.clone(); std::thread::spawn(move || { let mut seen = 0; loop { let g = t.gen.load(Ordering::Acquire); if g != seen { seen = g; let f = t.job.lock().unwrap().clone().unwrap(); f(1); t.done.fetch_add(1, Ordering::Release); } else { std::hint::spin_loop(); } } }); }
    let gap_us: u64 = std::env::var("GAP").ok().map(|s| s.parse().unwrap()).unwrap_or(0);
    let bytes = (total * 4) as f64;
    let mut ratios = vec![]; let mut sums = vec![]; let mut steps = vec![];
    for _ in 0..60 {
        // sum pass: one region
        let t0 = Instant::now();
        let cur = Arc::new(AtomicUsize::new(0));
        let f: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |_tid| unsafe {
            let blocks = total / 4096; let g = blocks / 16;
            loop { let s = cur.fetch_add(g, Ordering::Relaxed); if s >= blocks { break; } let e = (s + g).min(blocks); std::hint::black_box(sum_range((ap as *const f32).add(s * 4096), (e - s) * 4096)); }
        });
        team_run(&team, f);
        let ts = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let pf_kb: usize = std::env::var("PFKB").ok().map(|s| s.parse().unwrap()).unwrap_or(0);
        for (i, &(n, k)) in shapes.iter().enumerate() {
            let wq = ap + offs[i] * 4;
            let next = if i + 1 < shapes.len() { Some((ap + offs[i + 1] * 4, shapes[i + 1])) } else { None };
            let cur = Arc::new(AtomicUsize::new(0));
            let f: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |tid| unsafe {
                let g = ((n / 16) / 16).max(1) * 16;
                let mut first = pf_kb > 0;
                loop {
                    let s = if first { first = false; tid * g } else { let c = cur.fetch_add(g, Ordering::Relaxed) + 2 * g; if pf_kb > 0 { c } else { c - 2 * g } };
                    if s >= n { break; }
                    let e = (s + g).min(n);
                    gemvn::<4>(xp as _, wq as _, k, s, e, op as _);
                }
                if let Some((nw, (nn, nk))) = next {
                    if pf_kb > 0 {
                        let ng = ((nn / 16) / 16).max(1) * 16;
                        let start = nw + tid * ng * nk * 4;
                        let bytes = (ng * nk * 4).min(pf_kb * 1024);
                        let mut b = 0;
                        while b < bytes { _mm_prefetch::<_MM_HINT_T1>((start + b) as *const i8); b += 64; }
                    }
                }
            });
            team_run(&team, f);
            if gap_us > 0 { let t = Instant::now(); while t.elapsed().as_micros() < gap_us as u128 { std::hint::spin_loop(); } }
        }
        let tt = t1.elapsed().as_secs_f64();
        ratios.push(ts / tt); sums.push(bytes / ts / 1e9); steps.push(bytes / tt / 1e9);
    }
    let med = |v: &mut Vec<f64>| { v.sort_by(|a, b| a.partial_cmp(b).unwrap()); v[v.len() / 2] };
    print!("prefetch {} KiB, gap {gap_us} us: ", std::env::var("PFKB").unwrap_or("0".into()));
    println!(" sum {:.1} GB/s, step {:.1} GB/s, ratio {:.3}", med(&mut sums), med(&mut steps), med(&mut ratios));
}

fn main() {
    if std::env::var("STEP").is_ok() { step_mode(); return; }
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(32000);
    let k: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(768);
    let rounds: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(20);
    let variants: Vec<String> = args.get(4).map(|s| s.split(',').map(String::from).collect()).unwrap_or(vec!["sum".into(), "g8p0".into(), "g8p1".into(), "g8p2".into(), "g1p0".into()]);
    // several copies so total >> L3
    let copies = (400_000_000 / (n * k * 4)).max(1);
    let w: Vec<&'static mut [f32]> = (0..copies).map(|_| alloc_huge(n * k)).collect();
    let wp: Vec<usize> = w.iter().map(|s| s.as_ptr() as usize).collect();
    let x = alloc_huge(k); let xp = x.as_ptr() as usize;
    let out = alloc_huge(n); let op = out.as_mut_ptr() as usize;
    let team = Arc::new(Team { gen: AtomicUsize::new(0), done: AtomicUsize::new(0), job: std::sync::Mutex::new(None), stop: AtomicBool::new(false) });
    { let t = team.clone(); std::thread::spawn(move || { let mut seen = 0; loop { let g = t.gen.load(Ordering::Acquire); if g != seen { seen = g; let f = t.job.lock().unwrap().clone().unwrap(); f(1); t.done.fetch_add(1, Ordering::Release); } else { std::hint::spin_loop(); } if t.stop.load(Ordering::Relaxed) { break; } } }); }
    let mut res: Vec<Vec<f64>> = vec![vec![]; variants.len()];
    let bytes = (n * k * 4 * copies) as f64;
    let grain_rows: usize = std::env::var("GRAIN").ok().map(|s| s.parse().unwrap()).unwrap_or(0);
    for _ in 0..rounds {
        for (vi, v) in variants.iter().enumerate() {
            let v2 = v.clone(); let wp = wp.clone();
            let cursor = Arc::new(AtomicUsize::new(0));
            let t0 = Instant::now();
            for c in 0..copies {
                let wpc = wp[c]; let v3 = v2.clone(); let cur = Arc::new(AtomicUsize::new(0));
                let _ = &cursor;
                let f: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |tid: usize| unsafe {
                    let wq = wpc as *const f32;
                    if v3 == "sum1" {
                        let half = n * k / 2;
                        std::hint::black_box(sum1(wq.add(tid * half), half));
                        return;
                    }
                    if v3 == "sumc" {
                        let g = ((n / 16) / 16).max(1) * 16;
                        loop {
                            let s = cur.fetch_add(g, Ordering::Relaxed);
                            if s >= n { break; }
                            let e = (s + g).min(n);
                            std::hint::black_box(sum_range(wq.add(s * k), (e - s) * k));
                        }
                        return;
                    }
                    if v3 == "sum" {
                        let half = n * k / 2;
                        std::hint::black_box(sum_range(wq.add(tid * half), half));
                        return;
                    }
                    let pf: u32 = v3[3..].parse().unwrap();
                    let static_split = std::env::var("STATIC").is_ok();
                    if static_split {
                        let h = (n / 16) / 2 * 8 * 2; let (a, b) = if tid == 0 { (0, h) } else { (h, n) };
                        if v3.starts_with("g8") { gemv8(xp as _, wq, k, a, b, op as _, pf) } else { gemv1(xp as _, wq, k, a, b, op as _, pf) }
                        return;
                    }
                    let g = if grain_rows > 0 { grain_rows } else { ((n / 16) / 16).max(1) * 16 };
                    loop {
                        let s = cur.fetch_add(g, Ordering::Relaxed);
                        if s >= n { break; }
                        let e = (s + g).min(n);
                        match &v3[..3] { "g8p" => gemv8(xp as _, wq, k, s, e, op as _, pf), "g1p" => gemv1(xp as _, wq, k, s, e, op as _, pf), "n1p" => gemvn::<1>(xp as _, wq, k, s, e, op as _), "n2p" => gemvn::<2>(xp as _, wq, k, s, e, op as _), "n4p" => gemvn::<4>(xp as _, wq, k, s, e, op as _), _ => gemvn::<8>(xp as _, wq, k, s, e, op as _) }
                    }
                });
                team_run(&team, f);
            }
            let dt = t0.elapsed().as_secs_f64();
            res[vi].push(bytes / dt / 1e9);
        }
    }
    for (vi, v) in variants.iter().enumerate() {
        let mut r = res[vi].clone(); r.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let sum_med = { let mut s = res[0].clone(); s.sort_by(|a,b| a.partial_cmp(b).unwrap()); s[s.len()/2] };
        let ratios: Vec<f64> = res[vi].iter().zip(&res[0]).map(|(a,b)| a/b).collect();
        let mut rs = ratios.clone(); rs.sort_by(|a,b| a.partial_cmp(b).unwrap());
        println!("{v:6} median {:6.1} GB/s best {:6.1}  ratio-to-first median {:.3} (first median {:.1})", r[r.len()/2], r[r.len()-1], rs[rs.len()/2], sum_med);
    }
}
