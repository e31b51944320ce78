/**
 * Inline SVG loss curves: a mini sparkline per run in the panel, and a larger plot with axes
 * in the details view. No chart library: a polyline scaled into the box, coloured by the theme.
 */
const SVG = 'http://www.w3.org/2000/svg';

function el<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number>
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, String(v));
  }
  return node;
}

interface IBox {
  x0: number;
  x1: number;
  y0: number;
  y1: number;
}

function bounds(points: [number, number][]): IBox {
  const xs = points.map(p => p[0]);
  const ys = points.map(p => p[1]);
  const box = {
    x0: Math.min(...xs),
    x1: Math.max(...xs),
    y0: Math.min(...ys),
    y1: Math.max(...ys)
  };
  if (box.x1 === box.x0) {
    box.x1 = box.x0 + 1;
  }
  if (box.y1 === box.y0) {
    box.y1 = box.y0 + 1e-6;
  }
  return box;
}

function pointsAttr(
  points: [number, number][],
  box: IBox,
  w: number,
  h: number,
  pad: number
): string {
  return points
    .map(([x, y]) => {
      const px = pad + ((x - box.x0) / (box.x1 - box.x0)) * (w - 2 * pad);
      const py = pad + (1 - (y - box.y0) / (box.y1 - box.y0)) * (h - 2 * pad);
      return `${px.toFixed(1)},${py.toFixed(1)}`;
    })
    .join(' ');
}

/** Draw (or redraw) a sparkline of [step, loss] points into ``svg``. */
export function drawSparkline(
  svg: SVGSVGElement,
  points: [number, number][],
  width = 220,
  height = 36
): void {
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('data-points', String(points.length));
  svg.setAttribute('data-last-step', points.length ? String(points[points.length - 1][0]) : '');
  svg.replaceChildren();
  if (points.length < 2) {
    const text = el('text', { x: 4, y: height / 2 + 4, class: 'jp-WorkbenchSpark-empty' });
    text.textContent = points.length ? 'one loss point so far' : 'no loss yet';
    svg.appendChild(text);
    return;
  }
  const box = bounds(points);
  svg.appendChild(
    el('polyline', {
      points: pointsAttr(points, box, width, height, 3),
      class: 'jp-WorkbenchSpark-line'
    })
  );
  const last = svg.lastElementChild as SVGPolylineElement;
  const tail = last.getAttribute('points')!.split(' ').pop()!.split(',');
  svg.appendChild(el('circle', { cx: tail[0], cy: tail[1], r: 2.5, class: 'jp-WorkbenchSpark-dot' }));
}

/** One line of a plot: its points, and a class or a colour to draw it with. */
export interface ISeries {
  points: [number, number][];
  cls?: string;
  color?: string;
  label?: string;
}

/** A plot with axes of any number of [step, value] series, on one scale. */
export function drawPlot(
  svg: SVGSVGElement,
  series: ISeries[],
  width = 640,
  height = 260,
  empty = 'No loss points yet.'
): void {
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.replaceChildren();
  const all = series.flatMap(s => s.points);
  if (all.length < 2) {
    const text = el('text', { x: 12, y: 24, class: 'jp-WorkbenchSpark-empty' });
    text.textContent = empty;
    svg.appendChild(text);
    return;
  }
  const left = 52;
  const bottom = 28;
  const box = bounds(all);
  const g = el('g', { transform: `translate(${left},4)` });
  const w = width - left - 8;
  const h = height - bottom - 4;
  g.appendChild(el('rect', { x: 0, y: 0, width: w, height: h, class: 'jp-WorkbenchPlot-frame' }));
  for (let i = 0; i <= 4; i++) {
    const y = (h * i) / 4;
    const value = box.y1 - ((box.y1 - box.y0) * i) / 4;
    g.appendChild(el('line', { x1: 0, x2: w, y1: y, y2: y, class: 'jp-WorkbenchPlot-grid' }));
    const label = el('text', { x: -6, y: y + 4, 'text-anchor': 'end', class: 'jp-WorkbenchPlot-tick' });
    label.textContent = value.toPrecision(3);
    g.appendChild(label);
    const step = box.x0 + ((box.x1 - box.x0) * i) / 4;
    const xl = el('text', { x: (w * i) / 4, y: h + 18, 'text-anchor': 'middle', class: 'jp-WorkbenchPlot-tick' });
    xl.textContent = String(Math.round(step));
    g.appendChild(xl);
  }
  for (const s of series) {
    if (!s.points.length) {
      continue;
    }
    const line = el('polyline', { points: pointsAttr(s.points, box, w, h, 0), class: s.cls || '' });
    if (s.color) {
      line.setAttribute('style', `stroke:${s.color};fill:none;stroke-width:1.5`);
    }
    if (s.label) {
      line.setAttribute('data-label', s.label);
    }
    g.appendChild(line);
  }
  svg.appendChild(g);
}

/** The details view's plot: train loss and eval loss of one run. */
export function drawLossPlot(
  svg: SVGSVGElement,
  train: [number, number][],
  evals: [number, number][],
  width = 640,
  height = 260
): void {
  drawPlot(
    svg,
    [
      { points: train, cls: 'jp-WorkbenchPlot-train' },
      { points: evals, cls: 'jp-WorkbenchPlot-eval' }
    ],
    width,
    height
  );
}
