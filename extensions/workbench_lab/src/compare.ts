/**
 * RunsCompare: a main-area view of two or more runs side by side, opened by the panel's Compare
 * button. The settings that differ between the runs come first (what was changed), then the
 * losses and evaluation scores (the best of each column in bold), then every run's loss curve on
 * one plot. "Open as notebook" writes the same comparison as a notebook (answers side by side).
 */
import { Widget } from '@lumino/widgets';

import { ICompareColumn, ICompareReply, WorkbenchService } from './service';
import { drawPlot } from './sparkline';

// One colour per run, in table order (colour-blind safe, Okabe-Ito).
const COLOURS = ['#0072b2', '#e69f00', '#009e73', '#cc79a7', '#56b4e9', '#d55e00', '#000000'];

export class RunsCompare extends Widget {
  private readonly table = document.createElement('table');
  private readonly plot = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  private readonly legend = document.createElement('div');
  private readonly message = document.createElement('p');

  constructor(
    private readonly service: WorkbenchService,
    readonly runs: string[],
    openNotebook: () => void
  ) {
    super();
    this.addClass('jp-WorkbenchCompare');
    this.id = `workbench-compare-${runs.join('-')}`.slice(0, 200);
    this.title.label = `Compare ${runs.length} runs`;
    this.title.caption = runs.join(', ');
    this.title.closable = true;
    const bar = document.createElement('div');
    const refresh = document.createElement('button');
    refresh.className = 'jp-mod-styled';
    refresh.textContent = 'Refresh';
    refresh.addEventListener('click', () => void this.refresh());
    const notebook = document.createElement('button');
    notebook.className = 'jp-mod-styled';
    notebook.textContent = 'Open as notebook';
    notebook.title = 'the same comparison as a notebook, with the runs answering the same prompts';
    notebook.addEventListener('click', openNotebook);
    bar.append(refresh, notebook);
    const curves = document.createElement('h3');
    curves.textContent = 'Loss';
    this.plot.classList.add('jp-WorkbenchPlot');
    this.plot.setAttribute('role', 'img');
    this.plot.setAttribute('aria-label', 'loss of the compared runs');
    this.legend.className = 'jp-WorkbenchPlot-legend';
    this.message.hidden = true;
    this.node.append(bar, this.message, this.table, curves, this.plot, this.legend);
  }

  async refresh(): Promise<void> {
    try {
      this.render(await this.service.compare(this.runs));
      this.message.hidden = true;
    } catch (error) {
      this.message.textContent = `Could not compare the runs: ${(error as Error).message}`;
      this.message.hidden = false;
    }
  }

  private render(reply: ICompareReply): void {
    const columns = reply.columns;
    const best = columns.map((c, i) => bestOf(c, reply.rows.map(r => r.values[i])));
    const head = document.createElement('thead');
    const groups = head.insertRow();
    const names = head.insertRow();
    const group = (text: string, span: number, cls: string): void => {
      if (span) {
        const th = document.createElement('th');
        th.colSpan = span;
        th.textContent = text;
        th.className = cls;
        groups.append(th);
      }
    };
    group('', 1, '');
    group('differs', columns.filter(c => c.kind === 'setting').length, 'jp-mod-setting');
    group('results', columns.filter(c => c.kind === 'result').length, 'jp-mod-result');
    group('scores', columns.filter(c => c.kind === 'score').length, 'jp-mod-score');
    group('base model', columns.filter(c => c.kind === 'base').length, 'jp-mod-base');
    for (const title of ['run', ...columns.map(c => c.label)]) {
      const th = document.createElement('th');
      th.textContent = title;
      names.append(th);
    }
    const body = document.createElement('tbody');
    reply.rows.forEach((row, r) => {
      const tr = body.insertRow();
      tr.dataset.runId = row.id;
      const name = tr.insertCell();
      const swatch = document.createElement('span');
      swatch.className = 'jp-WorkbenchCompare-swatch';
      swatch.style.background = COLOURS[r % COLOURS.length];
      name.append(swatch, `${row.name} `);
      const id = document.createElement('small');
      id.textContent = row.id.slice(row.name.length + 1);
      name.append(id);
      row.values.forEach((v, i) => {
        const td = tr.insertCell();
        td.textContent = cell(v);
        td.className = `jp-mod-${columns[i].kind}`;
        if (best[i] !== null && v === best[i]) {
          td.classList.add('jp-mod-best');
        }
      });
    });
    this.table.replaceChildren(head, body);
    drawPlot(
      this.plot,
      reply.rows.map((row, r) => ({
        points: reply.curves[row.id] || [],
        color: COLOURS[r % COLOURS.length],
        label: row.id
      })),
      720,
      280
    );
    this.legend.replaceChildren(
      ...reply.rows.map((row, r) => {
        const span = document.createElement('span');
        span.innerHTML = `<span class="jp-WorkbenchCompare-swatch" style="background:${COLOURS[r % COLOURS.length]}"></span>`;
        span.append(`${row.id}  `);
        return span;
      })
    );
  }
}

/** A cell as people read it: numbers to 4 figures, nothing as a dash. */
function cell(v: number | string | boolean | null): string {
  if (v === null) {
    return '–';
  }
  return typeof v === 'number' ? String(Number(v.toPrecision(4))) : String(v);
}

/** The best value of a results or scores column (null: none, or nothing to rank). */
function bestOf(c: ICompareColumn, values: (number | string | boolean | null)[]): number | null {
  const numbers = values.filter((v): v is number => typeof v === 'number');
  if (!c.better || numbers.length < 2) {
    return null;
  }
  return c.better === 'lower' ? Math.min(...numbers) : Math.max(...numbers);
}
