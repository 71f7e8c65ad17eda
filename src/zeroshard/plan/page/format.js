// Number formatting that prints what `zeroshard plan` prints (render._fmt):
// bytes over the unit (1e9 for GB, 2^30 for GiB) with a fixed number of decimals.
"use strict";

const Format = (() => {
  // Python's format(x, ".Nf") and JavaScript's toFixed both round the exact binary
  // value, but on an exact tie Python picks the even digit and toFixed rounds up.
  // A tie at N decimals means x·2^(N+1) is an odd integer (x·10^N ends in exactly .5).
  function fixed(x, decimals) {
    const y = x * 2 ** (decimals + 1);
    if (!(Number.isInteger(y) && Math.abs(y) % 2 === 1)) return x.toFixed(decimals);
    const scaled = x * 10 ** decimals; // exact here: a small dyadic value
    let n = Math.floor(scaled);
    if (n % 2 !== 0) n += 1;
    return (n / 10 ** decimals).toFixed(decimals);
  }

  // render._fmt: "n/a" for an unknown figure; from a billion units on, powers of ten
  // written as Python writes them (1.60e+13: two exponent digits at least).
  function bytes(value, unit, decimals = 2) {
    if (value == null) return "n/a";
    const x = Number(value) / unit;
    if (Math.abs(x) >= 1e9) return x.toExponential(decimals).replace(/e([+-])(\d)$/, "e$10$2");
    return fixed(x, decimals);
  }

  // render.plan_table's "vs DDP" column.
  function ratio(comm, ddpComm) {
    return ddpComm === 0n ? "n/a" : `${fixed(Number(comm) / Number(ddpComm), 2)}x`;
  }

  // Python's f"{n:,}" for integer parameter counts.
  const count = (n) => String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ",");

  // Python's f"{x:g}" for the budget in the table heading (enough for GB figures).
  const general = (x) => String(Number(x.toPrecision(6)));

  return { fixed, bytes, ratio, count, general };
})();
