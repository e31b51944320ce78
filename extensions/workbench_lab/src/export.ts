/**
 * Export from the panel: the dialog that asks what to take home (merged weights, GGUF at f16 or
 * q4_k_m, an Ollama Modelfile), and what Details shows of an export under way or done. The
 * export itself is `workbench export` (docs/export.md), started by the server.
 */
import { Widget } from '@lumino/widgets';

import { terms } from './format';
import { IExportState } from './service';

export interface IExportChoice {
  formats: string[];
  quant: string[];
}

const CHOICES: [string, string, string][] = [
  // [value, label, what it is]
  ['merged', 'Merged weights', 'the adapter folded into the base (Hugging Face layout)'],
  ['gguf:f16', 'GGUF f16', 'llama.cpp, LM Studio: full precision'],
  ['gguf:q4_k_m', 'GGUF q4_k_m', 'llama.cpp: about a quarter of the size'],
  ['ollama', 'Ollama Modelfile', 'beside the GGUF: `ollama create` works as is']
];

/** The Export dialog's body: one checkbox per format (merged checked). */
export class ExportChooser extends Widget {
  private readonly boxes: [string, HTMLInputElement][] = [];

  constructor() {
    super();
    this.addClass('jp-WorkbenchExport');
    for (const [value, label, hint] of CHOICES) {
      const row = document.createElement('label');
      row.style.display = 'block';
      const box = document.createElement('input');
      box.type = 'checkbox';
      box.checked = value === 'merged';
      box.setAttribute('aria-label', `export ${label}`);
      row.append(box, ` ${label} `);
      const small = document.createElement('small');
      small.textContent = `— ${hint}`;
      row.append(small);
      this.boxes.push([value, box]);
      this.node.append(row);
    }
    const note = document.createElement('p');
    note.textContent =
      'Each file is checked by running it against the trained model; Details shows the progress.';
    this.node.append(note);
  }

  getValue(): IExportChoice {
    const picked = this.boxes.filter(([, b]) => b.checked).map(([v]) => v);
    const formats = new Set<string>();
    const quant: string[] = [];
    for (const v of picked) {
      if (v.startsWith('gguf:')) {
        formats.add('gguf');
        quant.push(v.slice(5));
      } else {
        formats.add(v);
      }
    }
    if (formats.has('ollama') && !quant.length) {
      quant.push('f16'); // the Modelfile points at a GGUF
    }
    return { formats: [...formats], quant: quant.length ? quant : ['f16'] };
  }
}

/** Details' Export section: the export under way (its last lines) or the last one's folders. */
export function renderExport(section: HTMLElement, state?: IExportState | null): void {
  section.hidden = !state;
  if (!state) {
    return;
  }
  const h = document.createElement('h3');
  h.textContent = 'Export';
  const parts: HTMLElement[] = [h];
  if (state.running) {
    const p = document.createElement('p');
    p.textContent = `Exporting ${(state.formats || []).join(', ')}…`;
    parts.push(p);
  }
  if (state.report && !state.running) {
    const dl = document.createElement('dl');
    dl.append(...terms(Object.entries(state.report.folders)));
    parts.push(dl);
  }
  if (state.log.length) {
    const pre = document.createElement('pre');
    pre.className = 'jp-WorkbenchDetails-exportlog';
    pre.textContent = state.log.join('\n');
    parts.push(pre);
  }
  section.replaceChildren(...parts);
}
