/**
 * RunDetails: a main-area view of one run — full loss plot (train and eval), the log tail with a
 * choice of log file, and the snapshots when the library reports them. It refreshes while the
 * run is live and stops once the run has ended.
 */
import { Widget } from '@lumino/widgets';

import { renderExport } from './export';
import { duration, money, number, runMoney, terms } from './format';
import { drawLossPlot } from './sparkline';
import { IRunDetails, IScore, ISnapshot, TERMINAL_STATES, WorkbenchService } from './service';

export class RunDetails extends Widget {
  private readonly summaryNode = document.createElement('dl');
  private readonly plot = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  private readonly logSelect = document.createElement('select');
  private readonly logNode = document.createElement('pre');
  private readonly snapshotsSection = document.createElement('section');
  private readonly scoresSection = document.createElement('section');
  private readonly settingsSection = document.createElement('section');
  private readonly exportSection = document.createElement('section');
  private timer: number | null = null;
  private logName: string | null = null;
  private specOpen = false; // kept across refreshes, so the spec stays open while it is read

  constructor(
    private readonly service: WorkbenchService,
    readonly runId: string,
    private intervalMs: number
  ) {
    super();
    this.addClass('jp-WorkbenchDetails');
    this.id = `workbench-run-${runId}`;
    this.title.label = runId;
    this.title.closable = true;
    this.node.tabIndex = -1;
    const plotTitle = document.createElement('h3');
    plotTitle.textContent = 'Loss';
    this.plot.classList.add('jp-WorkbenchPlot');
    this.plot.setAttribute('role', 'img');
    this.plot.setAttribute('aria-label', `loss of run ${runId}`);
    const legend = document.createElement('div');
    legend.className = 'jp-WorkbenchPlot-legend';
    legend.innerHTML =
      '<span class="jp-WorkbenchPlot-key jp-mod-train"></span>train loss ' +
      '<span class="jp-WorkbenchPlot-key jp-mod-eval"></span>eval loss';
    const logTitle = document.createElement('h3');
    logTitle.textContent = 'Logs';
    const label = document.createElement('label');
    label.textContent = 'Log file ';
    this.logSelect.setAttribute('aria-label', 'log file');
    this.logSelect.addEventListener('change', () => {
      this.logName = this.logSelect.value || null;
      void this.refresh();
    });
    label.append(this.logSelect);
    this.logNode.className = 'jp-WorkbenchDetails-log';
    this.logNode.tabIndex = 0;
    this.logNode.setAttribute('aria-label', 'log tail');
    this.snapshotsSection.hidden = true;
    this.scoresSection.className = 'jp-WorkbenchDetails-scores';
    this.settingsSection.className = 'jp-WorkbenchDetails-settings';
    this.exportSection.hidden = true;
    this.exportSection.className = 'jp-WorkbenchDetails-export';
    this.node.append(
      this.summaryNode,
      this.exportSection,
      this.scoresSection,
      this.settingsSection,
      plotTitle,
      this.plot,
      legend,
      logTitle,
      label,
      this.logNode,
      this.snapshotsSection
    );
  }

  set refreshInterval(seconds: number) {
    this.intervalMs = Math.max(500, seconds * 1000);
  }

  async refresh(): Promise<void> {
    let d: IRunDetails;
    try {
      d = await this.service.details(this.runId);
    } catch (error) {
      this.logNode.textContent = `Cannot read run ${this.runId}: ${(error as Error).message}`;
      return;
    }
    this.render(d);
    if (this.logName) {
      const reply = await this.service.logs(this.runId, this.logName, 200);
      this.logNode.textContent = reply.text;
    }
    // An ended run stops refreshing, unless an export of it is under way.
    this.schedule(TERMINAL_STATES.has(d.state || 'pending') && !d.export?.running);
  }

  protected onAfterAttach(): void {
    void this.refresh();
  }

  protected onBeforeDetach(): void {
    this.schedule(true);
  }

  private schedule(stop: boolean): void {
    if (this.timer !== null) {
      window.clearTimeout(this.timer);
      this.timer = null;
    }
    if (!stop && this.isAttached) {
      this.timer = window.setTimeout(() => void this.refresh(), this.intervalMs);
    }
  }

  private render(d: IRunDetails): void {
    this.title.label = d.name;
    this.title.caption = d.id;
    const rows: [string, string][] = [
      ['Run', d.id],
      ['State', d.state || 'pending'],
      ['Target', d.target],
      ['Step', `${d.step ?? 0} / ${d.total_steps ?? '?'}`],
      ['Loss', `${number(d.first_loss)} → ${number(d.last_loss)}`],
      ['Eval loss', number(d.eval_loss)],
      ['Tokens/s', d.tokens_per_s ? d.tokens_per_s.toFixed(0) : '–'],
      ['Elapsed', duration(d.elapsed_s)],
      ['ETA', TERMINAL_STATES.has(d.state || '') ? '–' : duration(d.eta_s)],
      ['Folder', d.run_dir]
    ];
    const cost = runMoney(d);
    if (cost) {
      rows.push(['Cost', cost]);
    }
    rows.push(...projection(d));
    if (d.error) {
      rows.push(['Error', d.error]);
    }
    this.summaryNode.replaceChildren(...terms(rows));
    const train = d.metrics.filter(m => m.loss !== undefined).map(m => [m.step, m.loss!] as [number, number]);
    const evals = d.metrics
      .filter(m => m.eval_loss !== undefined)
      .map(m => [m.step, m.eval_loss!] as [number, number]);
    drawLossPlot(this.plot, train, evals);
    const options = ['', ...d.log_names];
    if (options.join('|') !== Array.from(this.logSelect.options, o => o.value).join('|')) {
      this.logSelect.replaceChildren(
        ...options.map(name => {
          const o = document.createElement('option');
          o.value = name;
          o.textContent = name || 'all logs (tail)';
          return o;
        })
      );
      this.logSelect.value = this.logName ?? '';
    }
    if (!this.logName) {
      this.logNode.textContent = d.logs || '(no log lines yet)';
    }
    this.renderSnapshots(d.snapshots);
    this.renderScores(d.scores);
    renderExport(this.exportSection, d.export);
    this.renderSettings(d.settings, d.spec_yaml);
  }

  /** A table of the run's newest scores, the base model's beside them where it was scored. */
  private renderScores(scores?: IScore[]): void {
    this.scoresSection.hidden = scores === undefined;
    if (scores === undefined) {
      return;
    }
    const h = document.createElement('h3');
    h.textContent = 'Scores';
    if (!scores.length) {
      const p = document.createElement('p');
      p.textContent = 'Not evaluated yet: job.evaluate() or `workbench eval` scores it.';
      this.scoresSection.replaceChildren(h, p);
      return;
    }
    const table = document.createElement('table');
    const head = table.createTHead().insertRow();
    for (const title of ['task', 'metric', 'this run', 'base model', 'examples']) {
      const th = document.createElement('th');
      th.textContent = title;
      head.append(th);
    }
    const body = table.createTBody();
    for (const s of scores) {
      const row = body.insertRow();
      const cells = [
        s.task,
        s.metric,
        score(s.value),
        s.base == null ? '–' : score(s.base),
        s.n == null ? '–' : String(s.n)
      ];
      for (const text of cells) {
        row.insertCell().textContent = text;
      }
    }
    this.scoresSection.replaceChildren(h, table);
  }

  /** The knobs runs are compared by, and the whole spec (YAML) a click away. */
  private renderSettings(settings?: [string, string][], yaml?: string): void {
    this.settingsSection.hidden = settings === undefined;
    if (settings === undefined) {
      return;
    }
    const h = document.createElement('h3');
    h.textContent = 'Settings';
    const dl = document.createElement('dl');
    dl.append(...terms(settings));
    const full = document.createElement('details');
    const summary = document.createElement('summary');
    summary.textContent = 'Full spec (YAML)';
    const pre = document.createElement('pre');
    pre.textContent = yaml || '';
    full.append(summary, pre);
    full.open = this.specOpen;
    full.addEventListener('toggle', () => {
      this.specOpen = full.open;
    });
    this.settingsSection.replaceChildren(h, dl, full);
  }

  private renderSnapshots(snapshots: ISnapshot[] | null): void {
    this.snapshotsSection.hidden = snapshots === null;
    if (snapshots === null) {
      return;
    }
    const h = document.createElement('h3');
    h.textContent = 'Snapshots';
    const list = document.createElement('ul');
    list.append(
      ...snapshots.map(s => {
        const li = document.createElement('li');
        const notes = [s.complete ? 'complete' : 'incomplete (no manifest)'];
        if (s.latest) {
          notes.push('latest');
        }
        li.textContent = `${s.name} · ${notes.join(' · ')}`;
        return li;
      })
    );
    if (!snapshots.length) {
      const li = document.createElement('li');
      li.textContent = 'No snapshots yet.';
      list.append(li);
    }
    this.snapshotsSection.replaceChildren(h, list);
  }
}

/** A score as people read it: a share to 3 figures, anything larger to 1 decimal. */
function score(v: number): string {
  return Math.abs(v) <= 1 ? v.toFixed(3) : v.toFixed(1);
}

/** The live projection (status.json, from the measured pace) beside the plan: total time held
 * and cost at the end, with their ranges; shown while the run trains. */
export function projection(d: IRunDetails): [string, string][] {
  if (TERMINAL_STATES.has(d.state || '') || d.projected_total_s == null) {
    return [];
  }
  const out: [string, string][] = [];
  const range = (r?: [number, number] | null, f: (v: number) => string = duration): string =>
    r ? ` (${f(r[0])}–${f(r[1])})` : '';
  const planned = d.planned_total_s != null ? `; plan ${duration(d.planned_total_s)}` : '';
  out.push(['Projected time', duration(d.projected_total_s) + range(d.projected_total_range_s) + planned]);
  const text = d.money;
  if (text?.projected_cost) {
    // Written by the server; a run that bills nothing has none (its Cost row says 'free').
    const span = text.projected_cost_range ? ` (${text.projected_cost_range})` : '';
    const plannedCost = text.planned_cost ? `; plan ${text.planned_cost}` : '';
    out.push(['Projected cost', text.projected_cost + span + plannedCost]);
  } else if (!text && d.projected_cost != null) {
    const m = (v: number): string => money(v, d.currency) || v.toFixed(2);
    const plannedCost = d.planned_cost != null ? `; plan ${m(d.planned_cost)}` : '';
    out.push(['Projected cost', m(d.projected_cost) + range(d.projected_cost_range, m) + plannedCost]);
  }
  if (d.budget_warning) {
    out.push(['Budget', d.budget_warning]);
  }
  return out;
}
