//! The model on the CPU, in plain Rust: a two-layer perceptron (`relu(x W1 + b1) W2 + b2`)
//! learning a fixed teacher function from synthetic data with a mean squared error, and plain
//! SGD. The same functions train one process on the whole batch (the reference every run is
//! checked against) and each rank on its shard.

/// Layer sizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) d_in: usize,
    pub(crate) hidden: usize,
    pub(crate) d_out: usize,
}

/// Row-major weights and biases.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Params {
    pub(crate) w1: Vec<f32>, // d_in x hidden
    pub(crate) b1: Vec<f32>, // hidden
    pub(crate) w2: Vec<f32>, // hidden x d_out
    pub(crate) b2: Vec<f32>, // d_out
}

/// A small deterministic generator (every rank draws the same numbers).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// Uniform in [-1, 1).
    pub(crate) fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

impl Params {
    /// Small random weights (scaled by fan-in), zero biases.
    pub(crate) fn init(s: Shape, seed: u64) -> Params {
        let mut r = Rng::new(seed);
        let mut draw = |n: usize, fan_in: usize| -> Vec<f32> {
            let scale = 1.0 / (fan_in as f32).sqrt();
            (0..n).map(|_| r.next() * scale).collect()
        };
        Params {
            w1: draw(s.d_in * s.hidden, s.d_in),
            b1: vec![0.0; s.hidden],
            w2: draw(s.hidden * s.d_out, s.hidden),
            b2: vec![0.0; s.d_out],
        }
    }

    /// Layer 2's parameters then layer 1's, as one vector (the order the buckets have).
    pub(crate) fn flat(&self) -> Vec<f32> {
        [&self.w2[..], &self.b2, &self.w1, &self.b1].concat()
    }
}

/// `n` samples: inputs uniform in [-1, 1), targets `tanh(x A)` for a fixed teacher `A`.
pub(crate) fn data(s: Shape, n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut r = Rng::new(seed);
    let teacher: Vec<f32> = (0..s.d_in * s.d_out).map(|_| r.next()).collect();
    let x: Vec<f32> = (0..n * s.d_in).map(|_| r.next()).collect();
    let mut t = vec![0.0f32; n * s.d_out];
    matmul(&x, &teacher, &mut t, n, s.d_in, s.d_out);
    t.iter_mut().for_each(|v| *v = v.tanh());
    (x, t)
}

/// Rank `rank`'s shard: samples `rank`, `rank + world`, ... (every shard the same size).
pub(crate) fn shard(
    s: Shape,
    x: &[f32],
    t: &[f32],
    rank: usize,
    world: usize,
) -> (Vec<f32>, Vec<f32>) {
    let n = x.len() / s.d_in;
    let rows = (rank..n).step_by(world);
    let xs = rows
        .clone()
        .flat_map(|i| x[i * s.d_in..][..s.d_in].to_vec())
        .collect();
    let ts = rows
        .flat_map(|i| t[i * s.d_out..][..s.d_out].to_vec())
        .collect();
    (xs, ts)
}

/// `c = a b` for row-major `a` (m x k), `b` (k x n).
fn matmul(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    c.iter_mut().for_each(|v| *v = 0.0);
    for i in 0..m {
        for p in 0..k {
            let av = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += av * b[p * n + j];
            }
        }
    }
}

/// What the backward pass needs of the forward pass.
pub(crate) struct Forward {
    pub(crate) z1: Vec<f32>, // batch x hidden, before relu
    pub(crate) a1: Vec<f32>, // batch x hidden
    pub(crate) y: Vec<f32>,  // batch x d_out
}

pub(crate) fn forward(s: Shape, p: &Params, x: &[f32]) -> Forward {
    let b = x.len() / s.d_in;
    let mut z1 = vec![0.0; b * s.hidden];
    matmul(x, &p.w1, &mut z1, b, s.d_in, s.hidden);
    for row in z1.chunks_mut(s.hidden) {
        row.iter_mut().zip(&p.b1).for_each(|(v, bias)| *v += bias);
    }
    let a1: Vec<f32> = z1.iter().map(|v| v.max(0.0)).collect();
    let mut y = vec![0.0; b * s.d_out];
    matmul(&a1, &p.w2, &mut y, b, s.hidden, s.d_out);
    for row in y.chunks_mut(s.d_out) {
        row.iter_mut().zip(&p.b2).for_each(|(v, bias)| *v += bias);
    }
    Forward { z1, a1, y }
}

/// The loss, `mean over samples of ½ |y - t|²`.
pub(crate) fn loss(y: &[f32], t: &[f32], batch: usize) -> f32 {
    0.5 * y.iter().zip(t).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / batch as f32
}

/// Layer 2's gradient (`dW2` then `db2`: the first bucket) and the gradient at `a1`.
pub(crate) fn backward_layer2(
    s: Shape,
    p: &Params,
    f: &Forward,
    t: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let b = t.len() / s.d_out;
    let dy: Vec<f32> = f.y.iter().zip(t).map(|(y, t)| (y - t) / b as f32).collect();
    let mut grad = vec![0.0; s.hidden * s.d_out + s.d_out];
    let (dw2, db2) = grad.split_at_mut(s.hidden * s.d_out);
    for i in 0..b {
        for h in 0..s.hidden {
            let a = f.a1[i * s.hidden + h];
            for o in 0..s.d_out {
                dw2[h * s.d_out + o] += a * dy[i * s.d_out + o];
            }
        }
        for o in 0..s.d_out {
            db2[o] += dy[i * s.d_out + o];
        }
    }
    let mut da1 = vec![0.0; b * s.hidden];
    for i in 0..b {
        for h in 0..s.hidden {
            da1[i * s.hidden + h] = (0..s.d_out)
                .map(|o| dy[i * s.d_out + o] * p.w2[h * s.d_out + o])
                .sum();
        }
    }
    (grad, da1)
}

/// Layer 1's gradient (`dW1` then `db1`: the second bucket).
pub(crate) fn backward_layer1(s: Shape, f: &Forward, x: &[f32], da1: &[f32]) -> Vec<f32> {
    let b = x.len() / s.d_in;
    let dz1: Vec<f32> = da1
        .iter()
        .zip(&f.z1)
        .map(|(d, z)| if *z > 0.0 { *d } else { 0.0 })
        .collect();
    let mut grad = vec![0.0; s.d_in * s.hidden + s.hidden];
    let (dw1, db1) = grad.split_at_mut(s.d_in * s.hidden);
    for i in 0..b {
        for d in 0..s.d_in {
            let xv = x[i * s.d_in + d];
            for h in 0..s.hidden {
                dw1[d * s.hidden + h] += xv * dz1[i * s.hidden + h];
            }
        }
        for h in 0..s.hidden {
            db1[h] += dz1[i * s.hidden + h];
        }
    }
    grad
}

/// `p -= lr g` with the buckets' layout.
pub(crate) fn sgd(s: Shape, p: &mut Params, grad2: &[f32], grad1: &[f32], lr: f32) {
    let step = |w: &mut [f32], g: &[f32]| w.iter_mut().zip(g).for_each(|(w, g)| *w -= lr * g);
    let (dw2, db2) = grad2.split_at(s.hidden * s.d_out);
    let (dw1, db1) = grad1.split_at(s.d_in * s.hidden);
    step(&mut p.w2, dw2);
    step(&mut p.b2, db2);
    step(&mut p.w1, dw1);
    step(&mut p.b1, db1);
}

/// One process on the whole batch: the reference.
pub(crate) fn train_alone(
    s: Shape,
    mut p: Params,
    x: &[f32],
    t: &[f32],
    steps: usize,
    lr: f32,
) -> Params {
    for _ in 0..steps {
        let f = forward(s, &p, x);
        let (g2, da1) = backward_layer2(s, &p, &f, t);
        let g1 = backward_layer1(s, &f, x, &da1);
        sgd(s, &mut p, &g2, &g1, lr);
    }
    p
}

/// The largest difference between two parameter sets, relative to the largest parameter.
pub(crate) fn distance(a: &Params, b: &Params) -> f32 {
    let (fa, fb) = (a.flat(), b.flat());
    let scale = fa.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    fa.iter()
        .zip(&fb)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
