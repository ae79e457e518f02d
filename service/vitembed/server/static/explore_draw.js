// The explorer's drawings: pure functions of an API answer onto the page's canvases and tables (no state,
// no requests). Imported by explore.js.

const $ = (id) => document.getElementById(id);

function base64Bytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

export async function bitmapOf(encoded) {
  return createImageBitmap(new Blob([base64Bytes(encoded.base64)], { type: encoded.media_type }));
}

export function displayWidth(width) {
  return Math.min(448, Math.max(224, width * 2));
}

function drawGrid(ctx, width, height, grid, patch) {
  const [ph, pw] = patch;
  ctx.save();
  ctx.strokeStyle = "rgba(255, 255, 255, 0.55)";
  ctx.lineWidth = 1;
  ctx.beginPath();
  for (let c = 1; c < grid[1]; c += 1) {
    ctx.moveTo(c * pw + 0.5, 0);
    ctx.lineTo(c * pw + 0.5, height);
  }
  for (let r = 1; r < grid[0]; r += 1) {
    ctx.moveTo(0, r * ph + 0.5);
    ctx.lineTo(width, r * ph + 0.5);
  }
  ctx.stroke();
  ctx.restore();
}

// the query as the model sees it, its grid, the keyboard cursor (cyan) and the chosen patch (magenta)
export function paintView(f, bitmap, cursor, patch) {
  if (!f || !bitmap) return;
  const canvas = $("view");
  const [height, width] = f.size;
  canvas.width = width;
  canvas.height = height;
  canvas.style.width = `${displayWidth(width)}px`;
  canvas.dataset.grid = `${f.grid[0]}x${f.grid[1]}`;
  canvas.dataset.size = `${height}x${width}`;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(bitmap, 0, 0);
  drawGrid(ctx, width, height, f.grid, f.patch_size);
  const [ph, pw] = f.patch_size;
  const [cr, cc] = cursor;
  ctx.strokeStyle = "#00e5ff";
  ctx.lineWidth = 2;
  ctx.strokeRect(cc * pw + 1, cr * ph + 1, pw - 2, ph - 2);
  if (patch) {
    const [r, c] = patch;
    ctx.strokeStyle = "#ff2bd6";
    ctx.lineWidth = 3;
    ctx.strokeRect(c * pw + 1.5, r * ph + 1.5, pw - 3, ph - 3);
  }
}

export function putGridImage(canvas, rows, cols, colour) {
  canvas.width = cols;
  canvas.height = rows;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(cols, rows);
  for (let r = 0; r < rows; r += 1) {
    for (let c = 0; c < cols; c += 1) {
      const [red, green, blue] = colour(r, c);
      const at = 4 * (r * cols + c);
      image.data[at] = red;
      image.data[at + 1] = green;
      image.data[at + 2] = blue;
      image.data[at + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
}

export function drawPca(f) {
  const canvas = $("pca");
  const rgb = f.pca.rgb;
  putGridImage(canvas, f.grid[0], f.grid[1], (r, c) => rgb[r][c].map((v) => Math.round(v * 255)));
  canvas.style.width = `${displayWidth(f.size[1])}px`;
  canvas.style.height = `${(displayWidth(f.size[1]) * f.size[0]) / f.size[1]}px`;
  canvas.dataset.grid = `${f.grid[0]}x${f.grid[1]}`;
  const share = f.pca.explained.map((e) => `${(100 * e).toFixed(1)}%`).join(", ");
  const kept = f.pca.foreground.flat().filter(Boolean).length;
  const total = f.grid[0] * f.grid[1];
  let bg = kept === total ? "all patches" : `the ${kept} of ${total} patches that hold image (the letterbox, black, is left out)`;
  if (f.pca.threshold !== null) bg = `${kept} of ${total} patches kept as foreground (threshold ${f.pca.threshold.toFixed(2)}; background and letterbox black)`;
  $("pca-caption").textContent = `Block ${f.layer} of ${f.model}; red, green, blue = components 1, 2, 3, explaining ${share} of the variance; ${bg}.`;
}

// small values keep three significant digits (a tiny model's 0.0007 GFLOPs is not "0")
const fmt = (v, digits = 2) => {
  if (typeof v !== "number") return String(v);
  if (v !== 0 && Math.abs(v) < 1) return v.toLocaleString("en-US", { maximumSignificantDigits: 3 });
  return v.toLocaleString("en-US", { maximumFractionDigits: digits });
};

export function drawCost(f) {
  const c = f.cost;
  const rows = [
    ["Model input", `${c.height} × ${c.width} px (from ${f.source_size[0]} × ${f.source_size[1]}), policy ${f.policy}`],
    ["Patch grid", `${c.grid[0]} × ${c.grid[1]} of ${f.patch_size[0]} × ${f.patch_size[1]} px`],
    ["Patch tokens", fmt(c.tokens)],
    ["Sequence (with prefix tokens)", fmt(c.seq_len)],
    ["GFLOPs per image", fmt(c.gflops)],
    ["× the native size's FLOPs", `${fmt(c.flops_vs_native)}×${c.native ? " (native)" : ""}`],
    ["Attention entries per head per layer", fmt(c.attn_entries_per_head, 0)],
    ["Attention MB per layer (fp32)", fmt(c.attn_mb_per_layer)],
    ["Parameters", fmt(c.params, 0)],
  ];
  const body = $("cost").tBodies[0];
  body.replaceChildren(
    ...rows.map(([name, value]) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = name;
      const td = document.createElement("td");
      td.textContent = value;
      tr.append(th, td);
      return tr;
    }),
  );
  $("cost").hidden = false;
  $("view-caption").textContent = `${c.height} × ${c.width} px as the model sees it (${f.policy}); ${c.grid[0]} × ${c.grid[1]} = ${fmt(c.tokens)} patch tokens, ${fmt(c.gflops)} GFLOPs.`;
}

// a "hot" ramp: black -> red -> yellow; red + green grows with the value
export function heat(t) {
  return [Math.round(255 * Math.min(1, 2 * t)), Math.round(255 * Math.max(0, 2 * t - 1)), Math.round(64 * (1 - t))];
}

const CLASS_COLOURS = [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189], [140, 86, 75], [227, 119, 194], [127, 127, 127], [188, 189, 34], [23, 190, 207]];

export function patchHeadMap(grid, classes, name) {
  const wrap = document.createElement("div");
  const canvas = document.createElement("canvas");
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", `class of each patch according to head ${name}`);
  putGridImage(canvas, grid.length, grid[0].length, (r, c) => CLASS_COLOURS[grid[r][c] % CLASS_COLOURS.length]);
  canvas.className = "grid-map";
  canvas.style.width = "224px";
  canvas.style.height = `${(224 * grid.length) / grid[0].length}px`;
  const legend = document.createElement("ul");
  legend.className = "legend";
  legend.replaceChildren(
    ...classes.map((label, i) => {
      const li = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = `rgb(${CLASS_COLOURS[i % CLASS_COLOURS.length].join(",")})`;
      li.append(swatch, label);
      return li;
    }),
  );
  wrap.append(canvas, legend);
  return wrap;
}
